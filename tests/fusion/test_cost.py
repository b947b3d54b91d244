"""The fusion cost model: bytes of stored intermediates, rates from the target's
schedule, cache against memory bandwidth."""

from __future__ import annotations

import pytest

import neoflow
from neoflow.fusion import CostModel, Kernel, Machine
from neoflow.fusion.cost import Scheduled
from neoflow.targets.cpu.estimate import schedule

GRAPH = """
X = tensor([256, 256])
Y[i, j] = max(X[i, j], 0)
Z[i, j] = Y[i, j] * 2
"""
MACHINE = Machine(
    peak_flops=100e9,
    loop_flops=1e9,
    bandwidth=10e9,
    call_seconds=1e-6,
    vector_flops=8e9,
    cache_bandwidth=50e9,
    cache_bytes=1e6,
)


def test_inlining_drops_the_intermediate_write_and_read() -> None:
    graph = neoflow.graph(GRAPH)
    model = CostModel(MACHINE)
    apart = model.kernel_cost(graph, Kernel(("Y",), ("Y",))) + model.kernel_cost(graph, Kernel(("Z",), ("Z",)))
    fused = model.kernel_cost(graph, Kernel(("Y", "Z"), ("Z",)))
    assert apart.bytes - fused.bytes == 2 * 256 * 256 * 4
    assert fused.flops == apart.flops and fused.seconds < apart.seconds


def test_time_is_a_roofline_with_the_schedule_rate_and_the_cache_bandwidth_when_it_fits() -> None:
    op = neoflow.graph(GRAPH).op("Z")  # 256 KiB in, 256 KiB out, 65536 multiplies
    moved = 2 * 256 * 256 * 4
    scalar = CostModel(MACHINE).op_cost(op)
    assert scalar.seconds == pytest.approx(max(65536 / 1e9, moved / 50e9) + 1e-6)
    vector = CostModel(MACHINE, lambda op: Scheduled(vector=True)).op_cost(op)
    assert vector.seconds == pytest.approx(max(65536 / 8e9, moved / 50e9) + 1e-6)
    small_cache = CostModel(Machine(**{**MACHINE.__dict__, "cache_bytes": 1e5})).op_cost(op)
    assert small_cache.seconds == pytest.approx(max(65536 / 1e9, moved / 10e9) + 1e-6)
    blocked = CostModel(MACHINE, lambda op: Scheduled(fraction=0.5, flops=1e9)).op_cost(op)
    assert blocked.flops == 1e9 and blocked.seconds == pytest.approx(1e9 / 50e9 + 1e-6)


def test_the_cpu_schedule_names_each_kind_of_code() -> None:
    gemm = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (256, 256), "B": (256, 256)})
    assert 0.3 < schedule(gemm).fraction <= 1.0
    assert schedule(neoflow.op("Y[i] = exp(X[i])", shapes={"X": (1000,)})) == Scheduled(vector=True)
    # a transposed or a depth-to-space read would need gathers: a scalar loop
    assert not schedule(neoflow.op("Y[i, j] = X[j, i] * 2", shapes={"X": (64, 64)})).vector
    assert not schedule(neoflow.op("Y[i, j] = X[i, j // 2]", shapes={"X": (64, 32)})).vector
    total = neoflow.op("L[] = ReduceAdd({i}, X[i] * X[i])", shapes={"X": (1000,)})
    assert schedule(total).vector
    chain = neoflow.op(
        "E[i, n] = ReduceAdd({l}, ReduceAdd({k}, A[i, k] * B[k, l]) * D[l, n])",
        shapes={"A": (512, 64), "B": (64, 512), "D": (512, 64)},
    )
    # the inner sum once per (i, l), not once per (i, l, n)
    assert schedule(chain).flops == 2 * 512 * 512 * (64 + 64)


def test_the_cpu_schedule_is_worked_out_once_for_ops_that_differ_in_their_tensors_names_alone() -> None:
    from neoflow.ir.op import positional_names
    from neoflow.targets.cpu.estimate import _schedule_once

    text = "{C}[i, j] = ReduceAdd({{k}}, {A}[i, k] * {B}[k, j])"
    shapes = {"A": (96, 80), "B": (80, 112)}
    first = neoflow.op(text.format(C="C", A="A", B="B"), shapes=shapes)
    second = neoflow.op(text.format(C="D", A="E", B="F"), shapes={"E": (96, 80), "F": (80, 112)})
    swapped = neoflow.op(text.format(C="C", A="B", B="A"), shapes={"B": (96, 80), "A": (80, 112)})
    assert positional_names(first) == positional_names(second) == positional_names(swapped)
    square = {"A": (96, 96), "B": (96, 96)}
    one = neoflow.op(text.format(C="C", A="A", B="A"), shapes={"A": (96, 96)})
    assert positional_names(one) != positional_names(neoflow.op(text.format(C="C", A="A", B="B"), shapes=square))
    _schedule_once.cache_clear()
    assert schedule(first) == schedule(second) == schedule(swapped)
    assert _schedule_once.cache_info().misses == 1  # the other two found it


def test_ops_in_one_loop_nest_read_what_they_share_once() -> None:
    # Y and Z both stored (kept), Z reading Y at its own point: as one nest, X is read once
    # and Y is not read back; apart, Z reads Y from memory
    text = """
X = tensor([256, 256])
Y[i, j] = max(X[i, j], 0)
Z[i, j] = Y[i, j] * 2 + X[i, j]
"""
    graph = neoflow.graph(text)
    kernel = Kernel(("Y", "Z"), ("Y", "Z"))
    size = 256 * 256 * 4
    apart = CostModel(MACHINE).kernel_cost(graph, kernel)
    assert apart.bytes == 2 * size + 3 * size  # Y: X in, Y out; Z: Y and X in, Z out
    nested = CostModel(MACHINE, nests=lambda ops, private: ()).kernel_cost(graph, kernel)
    assert nested.bytes == 3 * size  # X in, Y and Z out
    assert nested.flops == apart.flops and nested.seconds < apart.seconds
    refused = CostModel(MACHINE, nests=lambda ops, private: None).kernel_cost(graph, kernel)
    assert refused == apart


def test_a_buffered_op_in_a_loop_nest_is_neither_written_nor_read_back() -> None:
    # Z kept, Y in the nest's tile buffer: only X in and Z out; where the target runs
    # no loop nest, the buffered Y is stored and read back like a materialised one
    text = """
X = tensor([256, 256])
Y[i, j] = max(X[i, j], 0)
Z[i, j] = Y[i, j] * 2 + X[i, j] + Y[i, j]
"""
    graph = neoflow.graph(text)
    kernel = Kernel(("Y", "Z"), ("Z",), ("Y",))
    size = 256 * 256 * 4
    buffered = CostModel(MACHINE, nests=lambda ops, private: tuple(private)).kernel_cost(graph, kernel)
    assert buffered.bytes == 2 * size
    stored = CostModel(MACHINE, nests=lambda ops, private: None).kernel_cost(graph, kernel)
    assert stored.bytes == 2 * size + 3 * size
    recomputed = CostModel(MACHINE).kernel_cost(graph, Kernel(("Y", "Z"), ("Z",)))
    assert recomputed.bytes == 2 * size and recomputed.flops > buffered.flops
