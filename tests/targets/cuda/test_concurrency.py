"""Which kernels run at once on the GPU: ops ordered only by the device memory they share, lanes and
waits that keep every such order (checked on the CPU, for the shipped models' training steps)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.ir.graph import Graph
from neoflow.targets.cuda.concurrency import Schedule, op_dependencies, plan_regions, plan_schedule, schedule
from neoflow.targets.cuda.executor import ModelExecutor
from tests.targets.cuda.gpu_cases import all_ops, capsule

MODELS = Path(__file__).resolve().parents[3] / "models"


def _addresses(executor: ModelExecutor):
    """Where the CUDA executor would place each tensor: intermediates at their arena offsets
    (base 0), every other tensor and each workspace in its own allocation far beyond."""
    own: dict[str, int] = {}

    def address(name: str) -> int:
        if name in executor.plan.offsets and name not in executor.keep:
            return executor.plan.offsets[name]
        return own.setdefault(name, (1 + len(own)) << 40)

    workspaces = {name: address(f"{name}/workspace") for name, plan in executor.plans.items() if plan.workspace}
    return address, workspaces


def _before(order: Schedule) -> np.ndarray:
    """``before[u, v]``: task ``u`` finishes before task ``v`` starts (same lane and earlier, or
    waited for, transitively)."""
    count = len(order.tasks)
    before = np.zeros((count, count), dtype=bool)
    for v in range(count):
        for u in range(v):
            if order.lanes[u] == order.lanes[v] or u in order.waits[v]:
                before[u, v] = True
                before[:, v] |= before[:, u]
    return before


def test_a_custom_ops_forward_and_adjoints_run_at_once() -> None:
    ops = all_ops(capsule(1))
    graph = Graph.from_ops(ops, outputs=[op.name for op in ops])
    executor = ModelExecutor(graph, graph.outputs, precision="fp16")
    address, workspaces = _addresses(executor)
    order = plan_schedule(list(executor.plans.values()), address, workspaces)
    kernels = [t for t in order.tasks if t.piece is not None]
    assert {t.op for t in kernels} == {0, 1, 2}
    first_kernel_lane = {t.op: order.lanes[order.tasks.index(t)] for t in reversed(kernels)}
    assert len(set(first_kernel_lane.values())) == 3  # nothing orders them: three lanes
    assert not any(order.waits[k] for k, t in enumerate(order.tasks) if t.piece is None or t.op == 0)


def test_an_arena_place_reused_orders_its_reader_before_the_new_writer() -> None:
    # op 0 writes [0, 8); op 1 reads it, writes [8, 16); op 2 writes [0, 8) again (op 0's place reused)
    reads = [[(100, 108)], [(0, 8)], [(200, 208)]]
    writes = [[(0, 8)], [(8, 16)], [(0, 8)]]
    assert op_dependencies(reads, writes) == [set(), {0}, {0, 1}]
    order = schedule([1, 1, 1], [False, False, False], op_dependencies(reads, writes))
    assert _before(order)[1, 2] and _before(order)[0, 1]


def test_lanes_are_bounded_and_pieces_follow_their_memsets() -> None:
    order = schedule([3, 2, 1, 1, 1, 1], [True, False, False, False, False, False], [set()] * 6, max_lanes=2)
    assert order.lane_count == 2 and set(order.lanes) == {0, 1}
    before = _before(order)
    memset = order.tasks.index(next(t for t in order.tasks if t.piece is None))
    for k, task in enumerate(order.tasks):
        if task.op == 0 and task.piece is not None:
            assert before[memset, k]


@pytest.mark.parametrize("model", ["mlp.onnx", "cnn.onnx", "capsule28.onnx"])
def test_every_pair_of_ops_sharing_memory_keeps_its_order(model: str) -> None:
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd")
    compiled = neoflow.compile(MODELS / model, target="tensorcore", train=spec, fusion="neoflow")
    executor = compiled.executor_and_feed(compiled.example_batch(training=True), True)[0]
    assert isinstance(executor, ModelExecutor)
    plans = list(executor.plans.values())
    address, workspaces = _addresses(executor)
    order = plan_schedule(plans, address, workspaces)
    reads, writes = plan_regions(plans, address, workspaces)
    before = _before(order)

    def conflict(a: int, b: int) -> bool:
        overlap = lambda x, y: any(s < f and t < e for s, e in x for t, f in y)  # noqa: E731
        return overlap(writes[a], reads[b]) or overlap(writes[a], writes[b]) or overlap(reads[a], writes[b])

    checked = 0
    for v, later in enumerate(order.tasks):
        for u, earlier in enumerate(order.tasks[:v]):
            if earlier.op != later.op and conflict(earlier.op, later.op):
                assert before[u, v], f"{plans[earlier.op].op.name} and {plans[later.op].op.name} may overlap"
                checked += 1
    assert checked > 0
    assert order.lane_count > 1  # some ops of a training step run at once


def test_a_task_is_as_urgent_as_the_chain_of_tasks_after_it() -> None:
    # op 0 feeds ops 1 and 2; op 2 feeds op 3: 0 heads a chain of three, 2 one of two, 1 and 3 end theirs
    order = schedule([1, 1, 1, 1], [False] * 4, [set(), {0}, {0}, {2}])
    assert order.urgency(6) == (2, 0, 1, 0)
    assert order.urgency(2) == (1, 0, 1, 0)  # chains longer than the levels tie at the most urgent


def test_a_backward_pass_puts_the_input_gradient_chain_before_a_weight_gradient() -> None:
    # capsule28: the second layer's input gradient (4 lattice pieces), then the first layer's weight
    # gradient, run beside the second layer's weight gradient; the chain that goes on comes first
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd")
    compiled = neoflow.compile(MODELS / "capsule28.onnx", target="tensorcore", train=spec, fusion="neoflow")
    executor = compiled.executor_and_feed(compiled.example_batch(training=True), True)[0]
    plans = list(executor.plans.values())
    order = plan_schedule(plans, *_addresses(executor))
    urgency = dict.fromkeys((plans[t.op].op.name for t in order.tasks), 0)
    for task, level in zip(order.tasks, order.urgency(6), strict=True):
        urgency[plans[task.op].op.name] = max(urgency[plans[task.op].op.name], level)
    assert urgency["grad_a1"] > urgency["k2__next"] and urgency["grad_a1"] > urgency["k1__next"]
    assert urgency["a1"] == 5  # the forward pass heads the longest chain
