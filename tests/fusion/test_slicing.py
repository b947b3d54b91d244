"""Batch slicing: which ops run slice by slice, the plans that slice, and the sliced kernel's results."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.fusion import FusionPlan, Kernel, PlanError, apply_plan
from neoflow.fusion.cost import CostModel, Machine
from neoflow.fusion.plan import plan_from_kernels
from neoflow.fusion.slicing import ROWS, SUM, SliceRun, roles_in_kernel, slice_length, slice_role, sliced_ops
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import evaluate_graph
from neoflow.runtime.fusing import plan_for, slice_runs
from neoflow.targets.cpu.estimate import schedule
from neoflow.targets.cpu.executor import tensor_slots
from neoflow.targets.cpu.lower import lower_op
from neoflow.targets.cpu.nest import nest_buffers
from neoflow.targets.cpu.slices import one_thread, sliced_function
from tests.on_targets import NEEDS_CC

MODELS = Path(__file__).resolve().parents[2] / "models"

# a layer's forward and backward over a batch of 6: H, A, D, E row by row, G a weight's gradient
# (a sum over the batch), L a loss (a scaled sum), T a transpose and S a reversal, neither row by row;
# R reads a row of A and U the sum L, both from their own rows
LAYER = """
H[b, k] = ReduceAdd({c}, X[b, c] * W[k, c])
A[b, k] = max(H[b, k], 0)
D[b, k] = A[b, k] * Y[b, k]
E[b, c] = ReduceAdd({k}, D[b, k] * W[k, c])
G[k, c] = ReduceAdd({b}, D[b, k] * X[b, c])
L[] = ReduceAdd({b, k}, D[b, k] * D[b, k]) / 6
T[k, b] = A[b, k]
S[b, k] = A[5 - b, k]
R[b, k] = A[0, k] * Y[b, k]
U[b, c] = X[b, c] * L[]
"""


SMALL = {"X": (6, 5), "W": (4, 5), "Y": (6, 4)}
# wide enough that each op's own C shares its loops out among threads (a parallel region each)
WIDE = {"X": (6, 512), "W": (64, 512), "Y": (6, 64)}
SLICED = ("H", "A", "D", "E", "G", "L")


def _layer(shapes: dict = SMALL):
    return neoflow.graph(LAYER, shapes=shapes)


def test_roles_say_which_ops_run_row_by_row_and_which_sum_the_batch_away() -> None:
    ops = {op.name: op for op in _layer().ops}
    roles = {name: slice_role(op) for name, op in ops.items()}
    assert (roles["H"].kind, roles["H"].batch, roles["H"].sliced) == (ROWS, 6, {"X"})
    assert roles["E"].kind == ROWS and roles["E"].sliced == {"D"}  # W is read whole
    assert (roles["G"].kind, roles["G"].variable, roles["G"].sliced) == (SUM, "b", {"D", "X"})
    assert roles["L"].kind == SUM  # a sum times a factor
    assert roles["T"] is None and roles["S"] is None
    assert roles["R"].sliced == {"Y"} and roles["U"].sliced == {"X"}  # A and L read whole


@pytest.mark.parametrize(
    ("batch", "threads", "length"), [(32, 2, 16), (30, 4, 10), (31, 2, 31), (32, 1, 32), (8, 16, 1)]
)
def test_a_slice_is_the_fewest_rows_that_split_the_batch_among_the_threads(batch, threads, length) -> None:
    assert slice_length(batch, threads) == length


def test_the_sliced_ops_stop_at_a_read_of_a_sum_and_at_what_waits_on_an_op_outside() -> None:
    graph = _layer()
    chosen = sliced_ops(graph.ops, [op.name for op in graph.ops])
    assert chosen == ("H", "A", "D", "E", "G", "L")  # not T nor S, R reads a row of A, U the sum L
    roles = roles_in_kernel([graph.op(name) for name in ("H", "A", "D", "L", "U")])
    assert roles == "'U' reads the sum 'L' before its last slice"
    assert roles_in_kernel([graph.op("A"), graph.op("R")]) == "'R' reads 'A' other than row by row"
    assert "does not run slice by slice" in roles_in_kernel([graph.op("A"), graph.op("S")])
    assert "is a sum" in roles_in_kernel([graph.op("D"), graph.op("G")], private=["G"])


def _sliced_plan(length: int, shapes: dict = SMALL):
    graph = _layer(shapes)
    kernels = [Kernel(SLICED, ("A", "E", "G", "L"), ("H", "D"), length)]
    kernels += [Kernel((name,), (name,)) for name in ("T", "S", "R", "U")]
    return graph, plan_from_kernels(graph, kernels)


def _sliced_run(length: int, shapes: dict = SMALL):
    """The layer with ``SLICED`` as one sliced kernel of ``length`` rows a slice,
    compiled: ``(graph, executor, kernel groups, inputs, the interpreter's values)``."""
    from neoflow.targets.cpu.executor import CpuExecutor

    graph, plan = _sliced_plan(length, shapes)
    fused, groups = apply_plan(graph, plan)
    executor = CpuExecutor(fused, graph.outputs, groups, slice_runs(plan, groups))
    rng = np.random.default_rng(3)
    inputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    return graph, executor, groups, inputs, evaluate_graph(graph, inputs, keep=True)


@pytest.mark.parametrize(
    ("kernel", "message"),
    [
        (Kernel(("A", "R"), ("A", "R"), (), 2), "'R' reads 'A' other than row by row"),
        (Kernel(("H", "A"), ("A",), ("H",), 4), "slices of 4 rows do not split its 6 rows"),
    ],
)
def test_a_kernel_that_cannot_run_slice_by_slice_is_refused_with_the_reason(kernel: Kernel, message: str) -> None:
    graph = _layer()
    rest = [Kernel((op.name,), (op.name,)) for op in graph.ops if op.name not in kernel.ops]
    with pytest.raises(PlanError, match=message):
        plan_from_kernels(graph, [kernel, *rest])


@NEEDS_CC
@pytest.mark.parametrize(("length", "threads"), [(2, 2), (3, 2), (6, 1), (1, 4)])
def test_a_sliced_kernel_computes_what_the_interpreter_does(length: int, threads: int, monkeypatch) -> None:
    monkeypatch.setenv("NEOFLOW_NUM_THREADS", str(threads))
    graph, executor, groups, inputs, expected = _sliced_run(length)
    ((run, _),) = executor._sliced_functions.values()
    assert run == SliceRun(SLICED, length, ("H", "D"))
    assert "nf_sliced0(b);" in executor.source and not {"H", "D"} & set(executor.plan.offsets)
    for _ in range(2):  # the partial sums start from zero on every call
        got = executor.run(inputs)
        for name in graph.outputs:
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6, err_msg=name)
    alone = executor.kernel_call(groups[0], inputs)()  # the kernel timed alone: what it stores
    assert set(alone) == {"A", "E", "G", "L"}
    for name, value in alone.items():
        np.testing.assert_allclose(value, expected[name], rtol=1e-5, atol=1e-6, err_msg=name)


@NEEDS_CC
def test_the_ops_in_a_slice_open_no_parallel_region_of_their_own(monkeypatch) -> None:
    graph = _layer(WIDE)
    ops = [graph.op(name) for name in SLICED]
    assert sum(lower_op(op, "f").count("#pragma omp parallel") for op in ops) >= 3
    source = sliced_function(ops, 3, ("H", "D"), tensor_slots(graph), "nf_sliced0")
    # the slice loop's own region and loop, nothing more; the ops' vector loops kept
    assert source.count("#pragma omp parallel") == 1 and source.count("#pragma omp for") == 1
    assert "#pragma omp simd" in source and "omp_get_num_threads" not in source
    assert one_thread("#pragma omp parallel for collapse(2)\nfor (;;) me = omp_get_thread_num();") == "for (;;) me = 0;"
    monkeypatch.setenv("NEOFLOW_NUM_THREADS", "2")
    graph, executor, _, inputs, expected = _sliced_run(3, WIDE)
    got = executor.run(inputs)
    for name in graph.outputs:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-4, atol=1e-4, err_msg=name)


def test_the_cost_of_a_sliced_kernel_counts_only_what_reaches_memory() -> None:
    graph, plan = _sliced_plan(3)
    two = Machine(100e9, 4e9, 15e9, 1e-6, 16e9, 60e9, 8e6, measured=True, threads=2)
    model = CostModel(two, schedule)
    sliced = model.kernel_cost(graph, plan.kernels[0])
    sizes = {"A": 24, "E": 30, "G": 20, "L": 1, "X": 30, "W": 20, "Y": 24}
    assert sliced.bytes == 4 * sum(sizes.values())  # H and D stay in slice buffers
    one_slice = model.kernel_cost(graph, dataclasses.replace(plan.kernels[0], sliced=6))
    # one slice of six rows leaves one of the two threads idle: twice the time less the call
    assert one_slice.seconds - two.call_seconds == pytest.approx(2 * (sliced.seconds - two.call_seconds))


def capsule_step_plans(spec: neoflow.TrainSpec) -> tuple[Graph, dict[str, FusionPlan], CostModel]:
    """The capsule network's training step (before fusion), its ``elementwise`` and
    ``neoflow`` plans for fixed figures of a 2-thread machine, and that cost model."""
    model = neoflow.compile(MODELS / "capsule.onnx", train=spec, target="interp")
    planned = model._train.planned_graph
    two = Machine(198e9, 4.2e9, 35e9, 2.3e-6, 25.7e9, 104e9, 32e6, measured=True, threads=2)
    costs = CostModel(two, schedule, nest_buffers)
    return planned, {policy: plan_for(planned, policy, costs) for policy in ("elementwise", "neoflow")}, costs


def test_neoflow_runs_the_capsule_training_step_slice_by_slice() -> None:
    # forward and backward, every op but the optimizer's, in one kernel: the activations, the
    # logits and every gradient but the weights' stay in slice buffers (machine figures fixed)
    planned, plans, costs = capsule_step_plans(neoflow.TrainSpec(labels="y"))
    kernel = plans["neoflow"].kernel_of("c2")
    assert kernel.sliced == 16 and {"c1", "logits", "grad_c1", "grad_k1_"} <= set(kernel.ops)
    assert {"a1", "c2", "logits", "grad_c1"} <= set(kernel.buffered)
    assert set(kernel.materialized) == {"loss_value", "grad_w", "grad_b", "grad_k2_", "grad_k1_"}
    moved = {policy: costs.plan_cost(planned, plan).bytes for policy, plan in plans.items()}
    assert moved["neoflow"] <= 0.3 * moved["elementwise"]
    assert not any(k.sliced for k in plans["elementwise"].kernels)
