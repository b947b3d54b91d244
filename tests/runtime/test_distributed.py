"""Data-parallel training: the split of a step into pieces and buckets, and 2 gloo ranks on the
CPU giving what one process gives on the same global batch (``tests/runtime/dp_worker.py`` runs
on the ranks)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.runtime.distributed import (
    BUCKET_CAP_BYTES,
    MIN_BUCKET_BYTES,
    DistributedError,
    default_bucket_bytes,
    launch,
    nccl_environment,
    split_step,
)
from tests.runtime import dp_worker

ROOT = Path(__file__).resolve().parents[2]
#: cases at a GPU's size (``tests/targets/cuda/test_distributed.py``)
GPU_CASES = ("capsule28_momentum", "capsule28_fused")
WORKER_ENV = {"PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _training(case: str, batch: int | None = None):
    name, shape, *_ = dp_worker.CASES[case]
    shape = shape if batch is None else (batch, *shape[1:])
    model = neoflow.compile(dp_worker.model_source(name), train=dp_worker.spec(case), shapes={"x": shape})
    return model.training


@pytest.mark.parametrize("case", ["mlp_sgd", "cnn_adam", "capsule_sgd", "bn_sync"])
@pytest.mark.parametrize("bucket", [None, 512])
def test_split_runs_every_op_once_and_reads_only_what_came_before(case: str, bucket: int | None) -> None:
    training = _training(case)
    results = [training.loss, *training.updates.values()]
    split = split_step(training, results, bucket, sync_bn=dp_worker.CASES[case][3])
    ops = [op.name for segment in split.segments for op in segment.ops]
    assert sorted(ops) == sorted(op.name for op in training.graph.ops)
    available = {t.name for t in training.graph.inputs}
    for segment in split.segments:
        produced = {op.name for op in segment.ops}
        for op in segment.ops:
            assert set(op.input_names) <= available | produced, op.name
        assert set(segment.keep) <= produced
        available |= set(segment.keep)
        assert set(segment.reduce) <= available  # a bucket is reduced once its last member exists
    assert set(results) <= available
    gradients = set(training.gradients.values())
    reduced = [name for segment in split.segments for name in segment.reduce]
    assert gradients <= set(reduced) and len(reduced) == len(set(reduced))
    assert {n for b in split.buckets for n in b} >= gradients
    # the update reads the gradients; nothing before it does; each of its ops reads one, or a result of one
    updates = split.updates
    assert updates and split.segments[-len(updates) :] == updates
    assert all(not gradients.intersection(op.input_names) for s in split.segments[: -len(updates)] for op in s.ops)
    late = set(gradients)
    for op in (op for piece in updates for op in piece.ops):
        assert late.intersection(op.input_names), op.name
        late.add(op.name)
    # an update piece reads no bucket after the one it waits for, nor an update op of a later piece
    bucket_of = {name: k for k, b in enumerate(split.buckets) for name in b}
    assert [p.after for p in updates] == sorted({p.after for p in updates})
    for piece in updates:
        bucket_of |= {op.name: piece.after for op in piece.ops}
        assert all(bucket_of.get(n, 0) <= piece.after for op in piece.ops for n in op.input_names), piece.after
    if len(split.buckets) > 1 and case != "bn_sync":
        assert len(updates) > 1  # the first buckets' parameters are updated while the last travels
    if bucket == 512 and case != "bn_sync":
        assert len(split.buckets) > 1  # small buckets: communication starts before the reverse pass ends


def test_sync_bn_waits_on_the_batch_statistics_and_their_adjoints() -> None:
    training = _training("bn_sync")
    assert len(training.batch_statistics) == 2 and all(training.batch_statistics.values())
    results = [training.loss, *training.updates.values()]
    blocking = [s.reduce for s in split_step(training, results, sync_bn=True).segments if s.reduce and not s.overlap]
    expected = [*training.batch_statistics, *training.batch_statistics.values()]
    assert sorted(n for r in blocking for n in r) == sorted(expected)
    assert not any(not s.overlap for s in split_step(training, results, sync_bn=False).segments if s.reduce)


def test_nccl_runs_without_graph_mixing_support_unless_the_user_says_otherwise() -> None:
    assert nccl_environment({}) == {"NCCL_GRAPH_MIXING_SUPPORT": "0"}
    assert nccl_environment({"NCCL_GRAPH_MIXING_SUPPORT": "1"}) == {}


def test_default_buckets() -> None:
    assert default_bucket_bytes(1000) == MIN_BUCKET_BYTES
    assert default_bucket_bytes(8 << 20) == 2 << 20  # a small model's gradients still in 4 buckets
    assert default_bucket_bytes(1 << 30) == BUCKET_CAP_BYTES


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """Every case of ``dp_worker`` run on 2 gloo ranks."""
    out = tmp_path_factory.mktemp("dp")
    cases = [case for case in dp_worker.CASES if case not in GPU_CASES]
    launch(2, ["-m", "tests.runtime.dp_worker", str(out), "cpu", *cases, "diverge"], env=WORKER_ENV)
    return out


def _max_relative(got: dict, expected: dict) -> float:
    return max(float(np.abs(got[k] - expected[k]).max() / max(np.abs(expected[k]).max(), 1e-12)) for k in expected)


@pytest.mark.parametrize("case", [case for case in dp_worker.CASES if case not in GPU_CASES])
def test_two_ranks_train_as_one_process_on_the_global_batch(two_ranks: Path, case: str) -> None:
    check_against_one_process(two_ranks, case, "cpu", 1e-5)


def check_against_one_process(out: Path, case: str, target: str, tolerance: float) -> None:
    """The ranks' results of ``case`` in ``out``: the same bits on both, and within ``tolerance``
    (relative) of one process training on the global batch (``bn_local``: not, by design)."""
    single = dp_worker.compile_case(case, target, dp_worker.CASES[case][1][0])
    losses = [single.train_step(batch) for batch in dp_worker.batches(case)]
    expected = dp_worker.state(single)
    ranks = [dict(np.load(out / f"{case}_{rank}.npz")) for rank in (0, 1)]
    for tensor in expected:  # the ranks hold the very same bits
        np.testing.assert_array_equal(ranks[0][tensor], ranks[1][tensor], err_msg=tensor)
    got = {k: v for k, v in ranks[0].items() if k != "losses"}
    if case == "bn_local":  # each rank normalised with its own half's statistics, as DDP does
        assert _max_relative(got, expected) > 1e-3
        return
    assert _max_relative(got, expected) < tolerance
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=tolerance)
    assert int((out / f"{case}_0.segments").read_text()) >= 2


def test_a_rank_whose_parameters_diverge_is_named(two_ranks: Path) -> None:
    for rank in (0, 1):
        message = (two_ranks / f"diverge_{rank}.txt").read_text()
        assert "'w1' differs between rank 0 and rank 1" in message


def test_a_failed_rank_stops_the_others_and_is_named(tmp_path: Path) -> None:
    # rank 1 leaves its error and exits; whether it is gone before the launcher stops it with rank 0 (whose
    # all-reduce then fails) is a race: its exit code is shown only where it exited on its own
    with pytest.raises(
        DistributedError,
        match=r"rank 1 failed( \(exit code 1\))?: input error: rank 1 gives up; the other ranks were stopped",
    ):
        launch(2, ["-m", "tests.runtime.dp_worker", str(tmp_path), "cpu", "fail"], env=WORKER_ENV)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **WORKER_ENV}
    return subprocess.run(
        [sys.executable, "-m", "neoflow.cli", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def test_cli_nproc_trains_like_one_process_and_rank_0_alone_reports(tmp_path: Path) -> None:
    build = tmp_path / "build"
    compiled = _cli(
        "compile", str(ROOT / "models" / "mlp.onnx"), "--train", "--target", "cpu", "-o", str(build), cwd=tmp_path
    )
    assert compiled.returncode == 0, compiled.stderr
    alone = _cli(
        "train", str(build), "--data", "digits", "--epochs", "2", "--batch", "64", "-o", "a.onnx", cwd=tmp_path
    )
    assert alone.returncode == 0, alone.stderr
    both = _cli("train", str(build), "--data", "digits", "--epochs", "2", "--nproc", "2", "-o", "b.onnx", cwd=tmp_path)
    assert both.returncode == 0, both.stderr
    assert "batch 64 (32 on each of 2 ranks, gloo)" in both.stdout
    lines = [line for line in both.stdout.splitlines() if line.startswith("epoch")]
    assert [line.split()[:4] for line in lines] == [
        line.split()[:4] for line in alone.stdout.splitlines() if line.startswith("epoch")
    ]  # one line per epoch (rank 0's), the same losses
    assert "test accuracy" in both.stdout and (tmp_path / "b.onnx").is_file()
    bad = _cli("train", str(build), "--data", "digits", "--nproc", "2", "--batch", "63", cwd=tmp_path)
    assert bad.returncode == 1
    (line,) = bad.stderr.strip().splitlines()  # one line, once, though both ranks failed
    assert re.fullmatch(
        r"neoflow: distributed error: rank [01] failed( \(exit code 1\))?: input error: --batch 63 \(the global "
        r"batch\) is not a multiple of the 2 ranks; the other ranks were stopped",
        line,
    )
