"""Which kernels run at once on the GPU: ops ordered only by the device memory they share, lanes and
waits that keep every such order (checked on the CPU, for the shipped models' training steps)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.ir.graph import Graph
from neoflow.targets.cuda.concurrency import (
    Schedule,
    Task,
    memset_dependencies,
    op_dependencies,
    plan_regions,
    plan_schedule,
    schedule,
)
from neoflow.targets.cuda.emit import finish_source
from neoflow.targets.cuda.executor import ModelExecutor
from neoflow.targets.cuda.plan import MmaKernel
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
    order = schedule([1, 1, 1], [None, None, None], op_dependencies(reads, writes))
    assert _before(order)[1, 2] and _before(order)[0, 1]


def test_lanes_are_bounded_and_pieces_follow_their_memsets() -> None:
    order = schedule([3, 2, 1, 1, 1, 1], [set(), None, None, None, None, None], [set()] * 6, max_lanes=2)
    assert order.lane_count == 2 and set(order.lanes) == {0, 1}
    before = _before(order)
    memset = order.tasks.index(next(t for t in order.tasks if t.piece is None))
    for k, task in enumerate(order.tasks):
        if task.op == 0 and task.piece is not None:
            assert before[memset, k]


def test_a_memset_of_memory_no_earlier_op_uses_starts_the_run() -> None:
    # op 1 zeroes its workspace (used by nothing before it); op 2 zeroes an arena place op 0 read
    order = schedule([1, 1, 1], [None, set(), {0}], [set(), {0}, {0}])
    assert order.tasks[0] == Task(1, None) and order.follows[0] == ()
    before = _before(order)
    memset_2 = order.tasks.index(Task(2, None))
    assert before[order.tasks.index(Task(0, 0)), memset_2]  # after the reader of the place it zeroes
    for op in (1, 2):  # each op's kernel after its memset and the op it depends on
        kernel = order.tasks.index(Task(op, 0))
        assert before[order.tasks.index(Task(op, None)), kernel] and before[order.tasks.index(Task(0, 0)), kernel]


def test_a_memset_follows_the_earlier_ops_using_the_memory_it_zeroes() -> None:
    # op 0 reads [0, 8); op 1 writes [8, 16); op 2 zeroes [0, 8) (a place op 0 read) and its workspace
    reads, writes = [[(0, 8)], [(100, 108)], []], [[(200, 208)], [(8, 16)], [(0, 8), (300, 304)]]
    zeroes = [[], [(8, 16)], [(0, 8), (300, 304)]]
    assert memset_dependencies(zeroes, reads, writes) == [None, set(), {0}]


def test_a_split_kernels_workspace_needs_no_memset_in_the_run() -> None:
    # its finishing kernels leave it zeroed for the next run (the executor zeroes it once)
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd")
    compiled = neoflow.compile(MODELS / "capsule28.onnx", target="tensorcore", train=spec, fusion="neoflow")
    executor = compiled.executor_and_feed(compiled.example_batch(training=True), True)[0]
    plans = list(executor.plans.values())
    split = {k for k, plan in enumerate(plans) if plan.workspace and not plan.zero_first}
    assert split  # the classifier's logits and the weight gradients split their depth
    order = plan_schedule(plans, *_addresses(executor))
    assert not [task for task in order.tasks if task.piece is None and task.op in split]
    kernel = next(k for k in plans[min(split)].kernels if isinstance(k, MmaKernel) and k.splits > 1)
    assert re.search(r"nf_ws\[[^]]+\] = 0\.0f;", finish_source(kernel))


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

    def regions(task: Task) -> tuple[list, list]:
        """What ``task`` reads and writes: a memset only the memory it zeroes."""
        if task.piece is not None:
            return reads[task.op], writes[task.op]
        written = writes[task.op]
        return [], ([written[0]] if plans[task.op].zero_first else []) + written[1:]

    def conflict(a: Task, b: Task) -> bool:
        overlap = lambda x, y: any(s < f and t < e for s, e in x for t, f in y)  # noqa: E731
        (read_a, write_a), (read_b, write_b) = regions(a), regions(b)
        return overlap(write_a, read_b) or overlap(write_a, write_b) or overlap(read_a, write_b)

    checked = 0
    for v, one in enumerate(order.tasks):
        for u, other in enumerate(order.tasks[:v]):
            if one.op != other.op and conflict(one, other):  # the graph's order is kept
                first, second = (u, v) if other.op < one.op else (v, u)
                assert before[first, second], f"{plans[one.op].op.name} and {plans[other.op].op.name} may overlap"
                checked += 1
            elif one.op == other.op and None in (one.piece, other.piece):  # a memset before its op's kernels
                assert before[u, v] and other.piece is None
    assert checked > 0
    assert order.lane_count > 1  # some ops of a training step run at once


def test_a_task_is_as_urgent_as_the_chain_of_tasks_after_it() -> None:
    # op 0 feeds ops 1 and 2; op 2 feeds op 3: 0 heads a chain of three, 2 one of two, 1 and 3 end theirs
    order = schedule([1, 1, 1, 1], [None] * 4, [set(), {0}, {0}, {2}])
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
        if task.piece is not None:  # a kernel's (a memset has no priority)
            urgency[plans[task.op].op.name] = max(urgency[plans[task.op].op.name], level)
    assert urgency["grad_a1"] > urgency["k2__next"] and urgency["grad_a1"] > urgency["k1__next"]
    assert urgency["a1"] == 5  # the forward pass heads the longest chain
