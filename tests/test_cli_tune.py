"""neoflow tune: kernels measured and kept, the step timed before and after; bad requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from neoflow.cli import main
from tests.on_targets import NEEDS_CC
from tests.targets.cuda.gpu_cases import gpu_reason

pytestmark = NEEDS_CC

MODELS = Path(__file__).resolve().parents[1] / "models"
PROGRAM = """
X = tensor([96, 200])
W = tensor([200, 64])
B = tensor([64])
V = tensor([32, 64])
Y[i, j] = max(ReduceAdd({k}, X[i, k] * W[k, j]) + B[j], 0)
Z[i, j] = ReduceAdd({k}, Y[i, k] * V[j, k])
"""


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("NEOFLOW_TUNING", raising=False)
    return tmp_path / "cache"


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


def test_tune_measures_each_kernel_keeps_the_results_and_times_the_step(cache: Path, tmp_path: Path, capsys) -> None:
    program = tmp_path / "net.nf"
    program.write_text(PROGRAM)
    before = program.read_text()
    # policy none: every op a kernel of its own (the neoflow policy runs both in one sliced kernel)
    assert main(["tune", str(program), "--budget", "60", "--no-progress", "--fusion", "none"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows[0] == ["kernel", "choice", "default ms", "tuned ms", "speedup", "candidates"]
    tuned = {row[0]: row for row in rows[2:]}
    assert set(tuned) == {"Y", "Z"}
    assert all(float(row[3]) <= float(row[2]) and int(row[5]) >= 2 for row in tuned.values())
    assert "2 kernel(s) tuned, 0 kernel(s) tuned before" in out
    assert "inference: " in out and "ms untuned" in out and "ms tuned" in out
    (table,) = (cache / "tuning").glob("cpu-*.json")
    assert {entry["op"] for entry in json.loads(table.read_text()).values()} == {"Y", "Z"}
    assert program.read_text() == before  # the input is never modified
    # a second run finds them tuned and measures nothing again
    assert main(["tune", str(program), "--budget", "60", "--no-progress", "--fusion", "none"]) == 0
    assert "0 kernel(s) tuned, 2 kernel(s) tuned before" in capsys.readouterr().out
    assert main(["tune", str(program), "--budget", "60", "--no-progress"]) == 0
    assert "no kernel of this model runs alone" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "0"], "--budget must be a positive number of seconds"),
        (["--budget", "-3"], "--budget must be a positive number of seconds"),
        (["--budget", "nan"], "--budget must be a positive number of seconds, got nan"),
        (["--fusion", "nope"], "unknown fusion policy 'nope'"),
        # without a GPU: said before anything is compiled
        *([(["--target", "cuda"], "cuda error")] if gpu_reason() else []),
    ],
)
def test_bad_requests_are_one_line_errors(args: list[str], message: str, cache: Path, capsys) -> None:
    assert main(["tune", str(MODELS / "four_op.nf"), *args]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert not (cache / "tuning").exists()


def test_a_missing_model_is_a_one_line_error(cache: Path, capsys) -> None:
    assert main(["tune", "no_such_model.onnx", "--budget", "5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "no_such_model.onnx" in err[-1]
