"""The cuda target's table of measured kernel choices: plans take what it records (and compute the same),
ignore what no candidate matches, a damaged table or ``NEOFLOW_TUNING=0``; on a GPU, the tuner fills it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

import neoflow
from neoflow.codegen.hardware import TENSOR_CORE
from neoflow.codegen.implicit_gemm import gemm_views
from neoflow.ir.graph import Graph
from neoflow.targets.cache import write_atomically
from neoflow.targets.cuda import tuning
from neoflow.targets.cuda.executor import ModelExecutor
from neoflow.targets.cuda.plan import MIN_SPLIT_TILES, candidates, plan_op, producer_twin, tensor_core_plan
from tests.targets.cuda.gpu_cases import capsule, gpu_reason, inputs_for

ARCH = "sm_90"


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NEOFLOW_TUNING", raising=False)
    return tmp_path


def _other(op, precision: str = "tf32"):
    """A candidate of each piece of ``op`` other than the model's choice (a depth split where one fits)."""
    planned = tensor_core_plan(op, "nf_op0", precision, ARCH, use_table=False)
    chosen = []
    for piece, view in enumerate(gemm_views(op, TENSOR_CORE)):
        model = planned.kernels[piece]
        others = [k for k in candidates(model.name, view, precision, ARCH) if k != model]
        chosen.append(next((k for k in others if k.splits > 1), others[0]))
    return planned, chosen


def _wrong(result) -> list[str]:
    """The candidates of a tuner's ``result`` rejected for their output (not for spilling registers)."""
    return [found for found in result.rejected if "spills" not in found]


def _write(op, kernels, precision: str = "tf32", beside: bool = False) -> set[str]:
    entries = {
        tuning.piece_key(op, k, precision, ARCH, beside): tuning.kernel_entry(kern) for k, kern in enumerate(kernels)
    }
    write_atomically(tuning.table_path(ARCH), json.dumps(entries).encode())
    return set(entries)


def test_plans_take_the_measured_kernel_and_compute_the_same(cache, monkeypatch) -> None:
    op = capsule(2)  # four lattice pieces
    planned, other = _other(op)
    _write(op, other)
    tuned = plan_op(op, "nf_op0", "tf32", ARCH)
    assert tuned.kernels == tuple(other) and tuned.kernels != planned.kernels
    inputs = inputs_for(op, seed=3)
    reference = neoflow.evaluate(op, inputs)
    found = ModelExecutor(Graph.from_ops([op]), [op.name], precision="tf32").run(inputs)[op.name]
    np.testing.assert_allclose(found, reference, rtol=0, atol=3e-3 * np.abs(reference).max())
    monkeypatch.setenv("NEOFLOW_TUNING", "0")
    assert plan_op(op, "nf_op0", "tf32", ARCH).kernels == planned.kernels


def test_an_entry_no_candidate_matches_or_a_damaged_table_leaves_the_models_choice(cache) -> None:
    op = capsule(1)
    planned, _ = _other(op)
    key = tuning.piece_key(op, 0, "tf32", ARCH)
    write_atomically(tuning.table_path(ARCH), json.dumps({key: {"tiles": [7, 7, 7, 1, 1], "wgmma": False}}).encode())
    assert plan_op(op, "nf_op0", "tf32", ARCH).kernels == planned.kernels
    write_atomically(tuning.table_path(ARCH), b'{"cut short": ')
    assert plan_op(op, "nf_op0", "tf32", ARCH).kernels == planned.kernels


def test_an_entry_may_name_a_kernel_only_the_tuner_tries(cache) -> None:
    op = capsule(1)
    planned = tensor_core_plan(op, "nf_op0", "tf32", ARCH, use_table=False)
    view = gemm_views(op, TENSOR_CORE)[0]
    sliced = next(k for k in candidates("nf_op0", view, "tf32", ARCH, tuner=True) if k.tiles.warps_k > 1)
    assert sliced not in candidates("nf_op0", view, "tf32", ARCH)  # the model never picks it alone
    _write(op, [sliced])
    assert tuning.kernel_entry(sliced)["tiles"][-1] == sliced.tiles.warps_k
    assert plan_op(op, "nf_op0", "tf32", ARCH).kernels == (sliced,) != planned.kernels
    twin = producer_twin(planned.kernels[0])
    assert twin is not None and twin not in candidates("nf_op0", view, "tf32", ARCH)
    _write(op, [twin])
    assert tuning.kernel_entry(twin)["specialized"]
    assert plan_op(op, "nf_op0", "tf32", ARCH).kernels == (twin,)


def test_an_op_beside_other_work_reads_only_what_was_measured_beside_other_work(cache) -> None:
    op = capsule(2)
    planned, other = _other(op)
    alone = _write(op, other)
    beside = plan_op(op, "nf_op0", "tf32", ARCH, beside=True).kernels
    assert beside != tuple(other)  # timed alone: not how it runs beside other work
    assert _write(op, other, beside=True).isdisjoint(alone)
    assert plan_op(op, "nf_op0", "tf32", ARCH, beside=True).kernels == tuple(other)
    assert plan_op(op, "nf_op0", "tf32", ARCH).kernels == planned.kernels


def test_pieces_are_keyed_by_what_they_compute_not_by_name(cache) -> None:
    op = capsule(1)
    renamed = neoflow.op(
        "Y[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In[b, c, p + r, q + s, i, t] * W[k, c, r, s, t, j])",
        shapes={t.name: t.shape for t in op.inputs},
    )
    assert tuning.piece_key(op, 0, "tf32", ARCH) == tuning.piece_key(renamed, 0, "tf32", ARCH)
    assert tuning.piece_key(op, 0, "tf32", ARCH) != tuning.piece_key(op, 0, "fp16", ARCH)
    assert tuning.piece_key(op, 0, "tf32", ARCH) != tuning.piece_key(capsule(2), 0, "tf32", ARCH)


@pytest.mark.skipif(gpu_reason() is not None, reason="no GPU")
def test_the_tuner_times_candidates_on_the_gpu_and_records_the_fastest(cache) -> None:
    from neoflow.targets.cuda import tuner

    op = capsule(2, batch=4, channels=16, out=7)
    results = tuner.tune_op(op, "tf32", ARCH)
    assert len(results) == len(gemm_views(op, TENSOR_CORE))
    for result in results:
        assert result.tried >= 2 and not _wrong(result)
        assert result.fastest_seconds <= result.chosen_seconds
    tuning.record(results, ARCH)
    assert tuner.tuned_pieces(op, "tf32", ARCH)
    assert plan_op(op, "nf_op0", "tf32", ARCH).kernels == tuple(r.fastest for r in results)


@pytest.mark.skipif(gpu_reason() is not None, reason="no GPU")
def test_the_tuner_times_ops_beside_other_work_in_their_graph(cache) -> None:
    from pathlib import Path

    from neoflow.targets.cuda import tuner
    from neoflow.targets.cuda.concurrency import ops_beside_others

    models = Path(__file__).resolve().parents[3] / "models"
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)
    model = neoflow.compile(models / "capsule28.onnx", target="cuda", train=spec, fusion="neoflow")
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((64, 1, 28, 28)).astype(np.float32), "y": rng.integers(0, 10, 64)}
    executor, feed = model.executor_and_feed(batch, True)
    # the second layer's weight gradient: on the tensor cores, beside the input gradient's chain
    assert "k2__next" in ops_beside_others(executor.graph)
    only = {"k2__next"}
    results = tuner.tune_beside(executor.graph, executor.keep, feed, executor.precision, executor.arch, only=only)
    assert results and {r.op for r in results} == only
    for result in results:
        assert result.tried >= 2 and not _wrong(result) and result.fastest_seconds <= result.chosen_seconds
        op = next(op for op in executor.graph.ops if op.name == result.op)
        taken = plan_op(op, "nf_op0", executor.precision, executor.arch, beside=True).kernels[result.piece]
        assert tuning.kernel_entry(taken) == tuning.kernel_entry(result.fastest)


def test_the_fusion_cost_model_plans_with_the_models_choices_not_the_table(cache) -> None:
    # the table is measured on the ops of a fusion plan: were the plan costed with it, it could change
    # (capsule28's tuned step planned other ops, which the table then did not know)
    from neoflow.targets.cuda import gpu_schedule

    op = capsule(2)
    before = gpu_schedule(op)
    _, other = _other(op)
    _write(op, other)
    taken = plan_op(op, "probe", "tf32", ARCH).kernels
    assert [tuning.kernel_entry(k) for k in taken] == [tuning.kernel_entry(k) for k in other]  # executors do
    assert gpu_schedule(op) == before


def test_a_graphs_ops_are_tuned_alone_then_those_beside_other_work_with_the_time_left(monkeypatch) -> None:
    import time
    from types import SimpleNamespace

    from neoflow.targets.cuda import tuner

    calls = []
    monkeypatch.setattr(tuner, "tune_ops", lambda ops, *args: calls.append(("alone", ops, args)) or ["a"])
    monkeypatch.setattr(tuner, "tune_beside", lambda *args: calls.append(("beside", args)) or ["b"])
    executor = SimpleNamespace(graph="graph", keep=("k",), precision="tf32", arch=ARCH)
    start = time.perf_counter()
    assert tuner.tune_graph(executor, "feed", ["op"], 30.0) == ["a", "b"]
    (alone, ops, (precision, arch, budget, _)), (beside, args) = calls
    assert (alone, ops, precision, arch, budget) == ("alone", ["op"], "tf32", ARCH, 30.0)
    graph, keep, feed, precision, arch, deadline = args
    assert (beside, graph, keep, feed, precision, arch) == ("beside", "graph", ("k",), "feed", "tf32", ARCH)
    assert start + 30.0 <= deadline <= time.perf_counter() + 30.0  # one budget for both


def test_a_kernels_neighbours_are_its_tiles_at_half_and_twice_its_depth_splits() -> None:
    from neoflow.targets.cuda import tuner

    op = neoflow.grad(capsule(2, batch=8, channels=16, out=12))["W"]  # 4608 deep: 144 tiles, splittable
    model = tensor_core_plan(op, "nf_op0", "tf32", ARCH, use_table=False).kernels[0]
    kernel = dataclasses.replace(producer_twin(model) or model, splits=4)
    assert kernel.depth_tiles >= 8 * MIN_SPLIT_TILES
    found = tuner.neighbours(kernel, "tf32", ARCH)
    assert sorted(k.splits for k in found) == [2, 8]
    assert all(dataclasses.replace(k, splits=4) == kernel for k in found)


def test_a_races_winner_races_its_neighbours_until_none_beats_it(monkeypatch) -> None:
    from types import SimpleNamespace

    from neoflow.targets.cuda import tuner

    made = {}

    def kernel(name: str, splits: int):
        return made.setdefault((name, splits), SimpleNamespace(name=name, splits=splits))

    speed = {("a", 1): 10.0, ("b", 1): 8.0, ("b", 2): 6.0, ("b", 4): 6.3, ("b", 8): 9.0}
    monkeypatch.setattr(
        tuner, "neighbours", lambda k, *_: [kernel(k.name, s) for s in (k.splits // 2, k.splits * 2) if s]
    )
    races = []

    def race(trial, variants, *args):
        races.append([(k.name, k.splits) for k in trial])
        seconds = [speed.get((k.name, k.splits), 99.0) for k in trial]
        best = min(range(len(trial)), key=seconds.__getitem__)
        best = best if seconds[best] < args[-1] * seconds[0] else 0
        return trial[best], seconds[0], seconds[best], len(trial), ()

    monkeypatch.setattr(tuner, "_race", race)
    trial = [kernel("a", 1), kernel("b", 1)]
    best, first, fastest, tried, _ = tuner._search(trial, lambda k: [k], None, (), {}, "tf32", ARCH, 0.95)
    # b wins the first race; b at 2 splits beats it; b at 4 (and 1, tried) do not: the search stops
    assert races == [[("a", 1), ("b", 1)], [("b", 1), ("b", 2)], [("b", 2), ("b", 4)]]
    assert (best.name, best.splits, first, tried) == ("b", 2, 10.0, 4)
    assert fastest == pytest.approx(6.0)


def test_a_candidate_that_spills_registers_is_not_timed(monkeypatch) -> None:
    from contextlib import nullcontext
    from types import SimpleNamespace

    from neoflow.targets.cuda import tuner

    timed = []
    # compiles in this process
    monkeypatch.setattr(tuner, "ProcessPoolExecutor", lambda workers: nullcontext(SimpleNamespace(map=map)))
    monkeypatch.setattr(tuner, "module_source", lambda variant: variant)
    monkeypatch.setattr(tuner, "compile_cubin", lambda stores, arch: SimpleNamespace(spills={"k": stores}))
    monkeypatch.setattr(tuner, "describe", lambda kernel: kernel.label)

    def executor(graph, keep, precision: str, arch: str, plans):
        return SimpleNamespace(run=lambda feed: {"t": np.ones(2)}, replay_graph=plans)

    monkeypatch.setattr(tuner, "CudaExecutor", executor)
    monkeypatch.setattr(tuner, "time_in_turns", lambda graphs: timed.extend(graphs) or [1.0 + g / 100 for g in graphs])
    trial = [SimpleNamespace(name="k", label=label) for label in ("model", "spills", "clean")]
    # spilled bytes stand for each variant's module: the incumbent's are forgiven, the others' not
    best, first, fastest, tried, rejected = tuner._race(trial, [8, 20, 0], None, (), {}, "tf32", ARCH, 0.95)
    assert timed == [8, 0] and rejected == ("spills (spills 20 bytes)",)
    assert (best.label, first, fastest, tried) == ("clean", 1.08, 1.0, 3)
