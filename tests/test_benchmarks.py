"""The benchmarks' own checks (their timing is ``neoflow.runtime.timing``: tests/runtime/test_timing.py)."""

from __future__ import annotations

import pytest


def test_the_gpu_operator_suite_matches_pytorch_on_the_cpu() -> None:
    import numpy as np
    import torch

    import neoflow
    from benchmarks.gpu_ops import operators

    cheap = {"gemv", "bilinear", "conv1d", "conv1d_transposed"}
    for operator in operators():
        op = neoflow.op(operator.text, shapes=operator.shapes, out_shape=operator.out_shape)
        rng = np.random.default_rng(0)
        arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in operator.shapes.items()}
        with torch.no_grad():
            theirs = operator.torch({name: torch.from_numpy(a) for name, a in arrays.items()}).numpy()
        assert op.shape == theirs.shape, operator.name
        if operator.name in cheap:  # the same values (the convolutions' sizes are for a GPU)
            ours = neoflow.evaluate(op, arrays)
            assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max(), operator.name


def test_the_cpu_kernel_workloads_compute_what_they_are_named() -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F

    import neoflow
    from benchmarks.kernels import kernels

    found = {k.name: k.graph() for k in kernels(batch=1)}
    rng = np.random.default_rng(0)

    def inputs(name: str) -> dict[str, np.ndarray]:
        return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in found[name].inputs}

    def close(ours, theirs) -> None:
        theirs = np.asarray(theirs)
        assert np.abs(np.asarray(ours) - theirs).max() <= 1e-4 * np.abs(theirs).max()

    arrays = inputs("depthwise conv 3x3")
    x, w = torch.from_numpy(arrays["X"]), torch.from_numpy(arrays["W"])
    close(neoflow.evaluate(found["depthwise conv 3x3"], arrays)["Y"], F.conv2d(x, w[:, None], padding=1, groups=96))
    arrays = inputs("grouped conv 3x3 (4 groups)")
    x, w = torch.from_numpy(arrays["X"]), torch.from_numpy(arrays["W"])
    close(neoflow.evaluate(found["grouped conv 3x3 (4 groups)"], arrays)["Y"], F.conv2d(x, w, padding=1, groups=4))
    arrays = inputs("BatchNorm statistics (mean, variance)")
    got = neoflow.evaluate(found["BatchNorm statistics (mean, variance)"], arrays)
    close(got["M"], arrays["X"].mean(axis=(0, 2, 3)))
    close(got["V"], arrays["X"].var(axis=(0, 2, 3)))
    # the adjoint at the batch's own statistics is PyTorch's BatchNorm adjoint
    arrays = inputs("BatchNorm adjoint")
    arrays["M"] = arrays["X"].mean(axis=(0, 2, 3))
    arrays["R"] = 1 / np.sqrt(arrays["X"].var(axis=(0, 2, 3)) + 1e-5)
    x = torch.from_numpy(arrays["X"]).requires_grad_()
    F.batch_norm(x, None, None, torch.from_numpy(arrays["G"]), None, training=True, eps=1e-5).backward(
        torch.from_numpy(arrays["DY"])
    )
    close(neoflow.evaluate(found["BatchNorm adjoint"], arrays)["DX"], x.grad)
    arrays = inputs("softmax rows")
    close(neoflow.evaluate(found["softmax rows"], arrays)["Y"], torch.softmax(torch.from_numpy(arrays["X"]), -1))
    arrays = inputs("LayerNorm rows")
    expected = F.layer_norm(
        torch.from_numpy(arrays["X"]), (128,), torch.from_numpy(arrays["G"]), torch.from_numpy(arrays["B"]), 1e-5
    )
    close(neoflow.evaluate(found["LayerNorm rows"], arrays)["Y"], expected)
    arrays = inputs("channel shuffle transpose")
    close(neoflow.evaluate(found["channel shuffle transpose"], arrays)["Y"], arrays["X"].transpose(0, 2, 1, 3, 4))


def test_the_cpu_benchmark_runs_only_the_workloads_asked_for(capsys) -> None:
    import pytest

    from benchmarks import run

    with pytest.raises(SystemExit) as stopped:  # before any workload is built or timed
        run.main(["--only", "no such workload"])
    assert stopped.value.code == 2
    assert "capsule conv stride 2" in capsys.readouterr().err  # the labels it knows are listed


def test_the_distributed_benchmarks_workers_run_with_the_runs_settings(tmp_path) -> None:
    from benchmarks.distributed import parser, worker_arguments

    settings = ["--target", "cuda", "--model", "capsule28", "--batch", "64", "--fusion", "neoflow", "--rounds", "3"]
    forwarded = worker_arguments(parser().parse_args(settings), tmp_path / "1.json")
    worker = parser().parse_args(forwarded)
    got = (worker.target, worker.model, worker.batch, worker.fusion, worker.rounds)
    assert got == ("cuda", "capsule28", 64, "neoflow", 3)
    assert worker.worker == str(tmp_path / "1.json")
    assert parser().parse_args([]).fusion == "none"  # the compiler's default


def test_the_distributed_benchmark_times_each_block_between_two_events_on_the_stream() -> None:
    from types import SimpleNamespace

    from benchmarks.distributed import _device_rounds

    clock, calls = [0.0], []

    class Event:  # a CUDA event on a clock in milliseconds that each call of a system moves on
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self, stream) -> None:
            self.at = clock[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end) -> float:
            return end.at - self.at

    def system(name: str, milliseconds: float):
        def call() -> None:
            calls.append(name)
            clock[0] += milliseconds

        return call

    torch = SimpleNamespace(cuda=SimpleNamespace(Event=Event))
    stream = SimpleNamespace(synchronize=lambda: None)
    systems = {"step": system("step", 2.0), "alone": system("alone", 0.5), "other": system("other", 1.0)}
    times = _device_rounds(torch, stream, systems, rounds=3, block=4, warmup=1)
    assert times == {name: [[pytest.approx(t)]] * 3 for name, t in (("step", 2e-3), ("alone", 5e-4), ("other", 1e-3))}
    firsts = [calls[3 + 12 * k] for k in range(3)]  # after the warm-up, each round's first call
    assert firsts == ["step", "alone", "other"]  # round k starts with the k-th system


def test_the_gpu_benchmark_writes_each_case_as_it_ends_and_the_summaries_after() -> None:
    from benchmarks.gpu import case_lines, summary_lines

    def case(name: str, ours: float, theirs: float, kernels) -> dict:
        times = {"neoflow": ours, "torch eager": theirs}
        return {"case": name, "times": times, "errors": {"Out": 1e-6}, "kernels": kernels}

    first = case("conv", 1e-3, 2e-3, [("Out", 1e-3, 2e-3), ("dIn", 2e-3, 3e-3)])
    second = case("gemm", 2e-3, 1e-3, [("C", 3e-3, 4e-3)])
    lines = case_lines(first)
    assert lines[0] == "## conv" and "| torch eager | 2.000 | 2.00x |" in lines and "| dIn | 2.000 | 3.000 |" in lines
    summary = "\n".join(summary_lines([first, second], [first, second]))
    assert "geomean 1.00x, lowest 0.50x" in summary  # sqrt(2 * 0.5)
    assert "3 ops' kernels" in summary and "Spearman rank correlation 1.000" in summary
    assert summary_lines([first], []) == []  # too few kernels to rank, no suite


def test_the_npu_benchmark_counts_each_ops_inputs_once_and_its_output_once() -> None:
    import neoflow
    from benchmarks.npu import compulsory_bytes

    product = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (8, 16), "B": (16, 4)})
    halves = neoflow.op("D[i, j] = C[i, j] * 0.5", shapes={"C": (8, 4)}, dtype="float16")
    assert compulsory_bytes([product]) == (8 * 16 + 16 * 4 + 8 * 4) * 4
    assert compulsory_bytes([product, halves]) == (8 * 16 + 16 * 4 + 8 * 4) * 4 + 2 * (8 * 4) * 2  # float16 in, out
