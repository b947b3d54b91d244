"""The neoflow command line."""

import subprocess
import sys
from pathlib import Path

import numpy as np

import neoflow
from neoflow.cli import main

MODELS = Path(__file__).resolve().parents[1] / "models"


def test_version(capsys) -> None:
    try:
        main(["--version"])
    except SystemExit as exit_:
        assert exit_.code == 0
    assert capsys.readouterr().out.strip() == f"neoflow {neoflow.__version__}"


def test_show_prints_ops_ranges_and_shapes(capsys) -> None:
    assert (
        main(
            [
                "show",
                "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
                "--shape",
                "B=1,3,228,228",
                "--shape",
                "C=64,3,3,3",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "D[n, k, p, q] = ReduceAdd({r, s, c}, B[n, c, 2*p + 2*r, 2*q + 2*s] * C[k, c, r, s])" in out
    assert "output   D[1, 64, 112, 112] float32" in out
    assert "p in [0, 112) (access bounds)" in out
    assert "c in [0, 3) (indexes B dim 1)" in out


def test_show_a_model_file(capsys) -> None:
    assert main(["show", str(MODELS / "four_op.nf")]) == 0
    out = capsys.readouterr().out
    assert "F[1, 19, 224, 224]" in out and out.strip().endswith("outputs F")


def test_errors_are_one_line_with_nonzero_exit(capsys) -> None:
    assert main(["show", "C[i] = A[i", "--shape", "A=3"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unbalanced bracket" in err and "line 1, column 9" in err
    assert main(["show", "no_such_file.nf"]) == 1
    assert "no such file" in capsys.readouterr().err


def test_run_writes_outputs(tmp_path, capsys) -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.save(tmp_path / "a.npy", a)
    assert (
        main(
            [
                "run",
                "Y[i] = ReduceAdd({j}, A[i, j])",
                "--shape",
                "A=2,3",
                "--input",
                f"A={tmp_path / 'a.npy'}",
                "-o",
                str(tmp_path / "out"),
            ]
        )
        == 0
    )
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "Y.npy"), a.sum(axis=1))
    assert main(["run", "Y[i] = A[i]", "--shape", "A=2"]) == 1
    assert "no value for input 'A'" in capsys.readouterr().err


def test_console_script_entry_point() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "neoflow.cli", "show", "Y[i] = X[i+1]", "--shape", "X=4", "--shape", "Y=4"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("neoflow: shape error: op 'Y'") and "Traceback" not in done.stderr
