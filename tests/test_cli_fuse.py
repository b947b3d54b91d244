"""neoflow fuse: per-kernel reports, policy comparisons, plots; bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from neoflow.cli import main
from tests.on_targets import NEEDS_CC

MODELS = Path(__file__).resolve().parents[1] / "models"
MLP = str(MODELS / "mlp.onnx")
QUICK = ["--target", "interp", "--repeats", "1"]


def _rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]


def test_report_has_one_row_per_kernel_with_measured_times(tmp_path: Path, capsys) -> None:
    report = tmp_path / "mlp.md"
    assert main(["fuse", MLP, "--train", "--policy", "elementwise", "--report", str(report), *QUICK]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    header, kernels, total = rows[0], rows[1:-1], rows[-1]
    assert header[:6] == ["#", "kernel", "ops", "materialised", "recomputed", "tile buffer"]
    assert header[-2:] == ["predicted ms", "measured ms"]
    assert len(kernels) >= 5 and total[1] == "total"
    # every kernel was timed, and the element-wise policy inlined something
    assert all(float(row[-1]) > 0 for row in kernels)
    assert any(row[4] != "-" for row in kernels)
    assert "training step, policy elementwise" in out
    assert report.read_text().strip() == out.split(f"wrote {report}")[0].strip()


def test_compare_draws_every_policy_including_a_user_policy(tmp_path: Path, capsys) -> None:
    plot, report = tmp_path / "cmp.png", tmp_path / "cmp.md"
    policies = "none,elementwise,neoflow,tests.fusion.user_policy:FirstReader"
    args = ["fuse", MLP, "--compare", policies, "--plot", str(plot), "--report", str(report), *QUICK, "--rounds", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    compared = _rows(out.split("policies compared")[1])
    assert [row[0] for row in compared[1:]] == ["none", "elementwise", "neoflow", "first-reader"]
    assert compared[0][-3:] == ["vs first", "its 95 % interval", "verdict"]
    assert compared[1][-3:] == ["1.00x", "", "baseline"]
    assert all(row[-1] in ("faster", "slower", "within noise") for row in compared[2:])
    assert "Machine: " in out and "3 rounds of" in out
    kernels = {row[0]: int(row[1]) for row in compared[1:]}
    assert kernels["none"] > kernels["elementwise"] >= kernels["neoflow"]
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and plot.stat().st_size > 10_000
    assert "first-reader" in report.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--policy", "nope"], "unknown fusion policy 'nope'"),
        (["--compare", "none,tests.fusion.user_policy:NotAPolicy"], "has no plan(graph, cost_model) method"),
        (["--plot", "x.png"], "--plot draws a comparison"),
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--compare", "none,neoflow", "--rounds", "1"], "--rounds must be at least 2"),
        (["--compare", "none,neoflow", "--seconds", "-1"], "--seconds must be a positive number"),
        (["--report", "no/such/dir/r.md"], "no such directory"),
    ],
)
def test_bad_requests_are_one_line_errors_and_write_nothing(
    args: list[str], message: str, tmp_path: Path, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["fuse", MLP, *args, "--target", "interp"]) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_a_missing_model_is_a_one_line_error(capsys) -> None:
    assert main(["fuse", "no_such_model.onnx", "--target", "interp"]) == 1
    assert "no_such_model.onnx" in capsys.readouterr().err


def test_a_training_step_whose_output_is_no_logits_names_the_other_losses(capsys) -> None:
    # the four-op graph's output is an image: cross-entropy (the default) cannot read it
    assert main(["fuse", str(MODELS / "four_op.onnx"), "--train", "--target", "interp"]) == 1
    err = capsys.readouterr().err.strip().splitlines()  # a progress line, then the error
    assert "'F' has shape [1, 19, 224, 224] (another loss: mse, or the name of a scalar output)" in err[-1]
    assert len(err) == 2 and err[0].startswith("policy neoflow:")


@pytest.mark.parametrize("target", ["interp", pytest.param("cpu", marks=NEEDS_CC)])
def test_two_identical_plans_are_called_the_same_plan_whatever_their_times(target: str, capsys) -> None:
    # same-as-none returns exactly none's plan: two identical plans measured in turns can still differ by a
    # few per cent on a loaded machine (a CI run called one "faster"); the verdict must not hang on that
    policies = "none,tests.fusion.user_policy:SameAsNone"
    assert main(["fuse", MLP, "--train", "--compare", policies, "--target", target, "--rounds", "3"]) == 0
    compared = _rows(capsys.readouterr().out.split("policies compared")[1])
    assert [row[0] for row in compared[1:]] == ["none", "same-as-none"]
    assert compared[1][1] == compared[2][1]  # the same kernels
    assert compared[2][-1] == "same plan"


def test_a_model_target_compares_its_predicted_times_exactly(capsys) -> None:
    assert main(["fuse", MLP, "--compare", "none,none", "--target", "tensorcore", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    compared = _rows(out.split("policies compared")[1])
    assert compared[2][-3:] == ["1.00x", "exact", "same"]
    assert "predicted times (exact)" in out


def _corpus_dir(tmp_path: Path, *names: str) -> Path:
    directory = tmp_path / "corpus"
    directory.mkdir()
    for name in names:
        (directory / name).write_bytes((MODELS / name).read_bytes())
    return directory


def test_the_corpus_plans_every_model_with_every_policy_and_ranks_them(tmp_path: Path, capsys) -> None:
    directory = _corpus_dir(tmp_path, "mlp.onnx", "cnn.onnx")
    plot = tmp_path / "corpus.png"
    args = ["fuse", "--corpus", str(directory), "--no-architectures", "--no-measure", "--plot", str(plot)]
    assert main([*args, "--target", "tensorcore,npu", "--compare", "none,neoflow,optimal"]) == 0
    out = capsys.readouterr().out
    rows = _rows(out)
    assert rows[0][:6] == ["model", "target", "policy", "kernels", "MB moved", "predicted ms"]
    assert rows[0][6:] == ["planning s", "predicted / optimal", "optimal's plan"]
    assert len(rows) == 1 + 2 * 2 * 3  # models x targets x policies
    assert {(r[0], r[1]) for r in rows[1:]} == {(m, t) for m in ("mlp.onnx", "cnn.onnx") for t in ("tensorcore", "npu")}
    assert all(r[7] == "1.000x" and r[8] for r in rows[1:] if r[2] == "optimal")
    assert all(float(r[7].rstrip("x")) >= 1.0 for r in rows[1:])  # nothing beats the optimum
    assert "- tensorcore: optimal 1.000x" in out and "- npu: optimal 1.000x" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@NEEDS_CC
def test_the_corpus_measures_the_steps_on_the_cpu(tmp_path: Path, capsys) -> None:
    directory = _corpus_dir(tmp_path, "mlp.onnx")
    args = ["fuse", "--corpus", str(directory), "--no-architectures", "--target", "cpu", "--rounds", "3"]
    assert main([*args, "--train", "--compare", "none,neoflow"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert rows[0][-2:] == ["measured ms", "verdict"]
    assert rows[1][-1] == "baseline" and rows[2][-1] in ("faster", "slower", "within noise")
    assert all(float(r[-2]) > 0 for r in rows[1:])


def test_the_corpus_holds_the_benchmark_architectures() -> None:
    from neoflow import corpus

    names = [entry.name for entry in corpus.entries()]
    assert {"mlp.onnx", "capsule.onnx", "resnet18", "mobilenet_v2", "shufflenet_v2", "vit"} <= set(names)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["fuse", MLP, "--corpus"], "give a model or --corpus (not both)"),
        (["fuse"], "give a model or --corpus (not both)"),
        (["fuse", "--corpus", "no/such/dir"], "no such corpus directory"),
    ],
)
def test_bad_corpus_requests_are_one_line_errors(args: list[str], message: str, capsys) -> None:
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
