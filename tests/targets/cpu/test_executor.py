"""The cpu executor's whole-graph entry point: one call per run, intermediates in an arena."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

import neoflow
from neoflow.ir.interpreter import evaluate_op
from neoflow.targets.base import run_graph
from neoflow.targets.cpu.executor import CpuExecutor, data_address
from tests.on_targets import NEEDS_CC

CHAIN = """
X = tensor([64, 48])
W = tensor([48, 32])
H[i, j] = ReduceAdd({k}, X[i, k] * W[k, j])
R[i, j] = max(H[i, j], 0)
S[i, j] = R[i, j] * 2 + H[i, j]
T[i, j] = S[i, j] - R[i, j]
L[] = ReduceAdd({i, j}, T[i, j] * T[i, j])
"""


def _reference(graph, inputs: dict) -> dict:
    values = dict(inputs)
    for op in graph.ops:
        values[op.name] = evaluate_op(op, {name: values[name] for name in op.input_names})
    return values


def _batches(seed: int, count: int) -> list[dict[str, np.ndarray]]:
    """``count`` random inputs of ``CHAIN``."""
    rng = np.random.default_rng(seed)
    return [
        {"X": rng.standard_normal((64, 48)).astype(np.float32), "W": rng.standard_normal((48, 32)).astype(np.float32)}
        for _ in range(count)
    ]


@NEEDS_CC
def test_a_run_is_one_call_and_computes_what_the_kernels_do_one_by_one() -> None:
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("T", "L"))
    assert executor.entry is not None and "nf_run_graph" in executor.source
    assert executor.plan.arena_bytes < sum(op.output.size * 4 for op in graph.ops), "slots are shared"
    rng = np.random.default_rng(0)
    inputs = {
        "X": rng.standard_normal((64, 48)).astype(np.float32),
        "W": rng.standard_normal((48, 32)).astype(np.float32),
    }
    whole = executor.run(inputs)
    one_by_one = run_graph(executor, inputs)
    expected = _reference(graph, inputs)
    for name in ("T", "L"):
        np.testing.assert_allclose(whole[name], one_by_one[name], rtol=1e-6)
        np.testing.assert_allclose(whole[name], expected[name], rtol=1e-4, atol=1e-3)


@NEEDS_CC
def test_kept_tensors_of_one_run_are_not_overwritten_by_the_next() -> None:
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("T",))
    rng = np.random.default_rng(1)
    first_inputs = {
        "X": rng.standard_normal((64, 48)).astype(np.float32),
        "W": rng.standard_normal((48, 32)).astype(np.float32),
    }
    first = executor.run(first_inputs)
    kept = first["T"].copy()
    executor.run({"X": -first_inputs["X"], "W": first_inputs["W"]})
    np.testing.assert_array_equal(first["T"], kept)


@NEEDS_CC
def test_runs_reuse_one_arena_and_threads_running_at_once_get_their_own() -> None:
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("T", "L"))
    batches = _batches(seed=2, count=8)
    executor.run(batches[0])
    arena = executor._arena
    assert arena is not None and arena.nbytes >= executor.plan.arena_bytes
    executor.run(batches[1])
    assert executor._arena is arena, "the second run should reuse the first run's arena"
    expected = [_reference(graph, batch) for batch in batches]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(executor.run, batches * 4))
    for k, result in enumerate(results):
        np.testing.assert_allclose(result["T"], expected[k % 8]["T"], rtol=1e-4, atol=1e-3)


@NEEDS_CC
def test_kept_tensors_share_one_block_at_aligned_addresses_and_read_only_inputs_are_read() -> None:
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("H", "T", "L"))
    rng = np.random.default_rng(3)
    inputs = {
        "X": rng.standard_normal((64, 48)).astype(np.float32),
        "W": rng.standard_normal((48, 32)).astype(np.float32),
    }
    for array in inputs.values():
        array.flags.writeable = False  # the buffer protocol refuses these: numpy gives the address
    result = executor.run(inputs)
    expected = _reference(graph, inputs)
    for name in ("H", "T", "L"):
        assert result[name].ctypes.data % 64 == 0, f"{name} is not 64-byte aligned"
        assert result[name].shape == expected[name].shape and result[name].dtype == np.float32
        np.testing.assert_allclose(result[name], expected[name], rtol=1e-4, atol=1e-3)
    assert result["H"].base is result["T"].base, "the kept tensors of a run are views of one block"
    assert not np.shares_memory(result["H"], result["T"])


@NEEDS_CC
def test_recycled_runs_write_two_blocks_in_turn_and_compute_what_fresh_runs_do() -> None:
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("T", "L"))
    batches = _batches(seed=4, count=3)
    results = [executor.run(batch, recycle=True) for batch in batches[:2]]
    kept = results[0]["T"].copy()
    assert not np.shares_memory(results[0]["T"], results[1]["T"]), "two runs in a row write two blocks"
    np.testing.assert_array_equal(results[0]["T"], kept)
    third = executor.run(batches[2], recycle=True)
    assert third["T"] is results[0]["T"], "the run after next writes the first run's arrays again"
    for batch, result in zip(batches[1:], [results[1], third], strict=True):
        fresh = executor.run(batch)
        np.testing.assert_array_equal(result["T"], fresh["T"])
        np.testing.assert_array_equal(result["L"], fresh["L"])


@NEEDS_CC
def test_a_recycled_run_reads_an_input_changed_in_place_or_converted_again() -> None:
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("T",))
    rng = np.random.default_rng(5)
    x = rng.standard_normal((64, 48)).astype(np.float32)
    w64 = rng.standard_normal((48, 32))  # float64: converted for every run
    for turn in range(6):  # the same two arrays every run, changed in place in between
        x *= -1.5
        w64 += 0.25
        result = executor.run({"X": x, "W": w64}, recycle=True)
        expected = _reference(graph, {"X": x.copy(), "W": w64.astype(np.float32)})
        np.testing.assert_allclose(result["T"], expected["T"], rtol=1e-4, atol=1e-3, err_msg=f"run {turn}")


def test_a_data_address_is_numpys_for_writable_read_only_and_empty_arrays() -> None:
    writable = np.arange(12, dtype=np.float32).reshape(3, 4)
    read_only = writable.copy()
    read_only.flags.writeable = False
    empty = np.zeros((0, 4), np.float32)
    view = np.zeros(64, np.uint8)[16:48].view(np.float32)
    for array in (writable, read_only, empty, view, np.array(2.0, np.float32)):
        assert data_address(array) == array.ctypes.data


@NEEDS_CC
def test_an_op_call_runs_only_the_kernel_on_buffers_prepared_once() -> None:
    # the fusion report times kernels through op_call: each call must recompute the op into the
    # same output (no conversion or allocation inside the timed call) and equal what run_op gives
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("L",))
    rng = np.random.default_rng(2)
    values = {
        "X": rng.standard_normal((64, 48)).astype(np.float32),
        "W": rng.standard_normal((48, 32)).astype(np.float32),
    }
    for op in graph.ops:
        call = executor.op_call(op, values)
        first = call()
        first_copy = first.copy()
        first[...] = np.nan
        again = call()
        assert again is first, f"{op.name}: the timed call should write the buffer prepared beforehand"
        np.testing.assert_array_equal(again, first_copy)
        np.testing.assert_array_equal(executor.run_op(op, values), first_copy)
        values[op.name] = again


@NEEDS_CC
def test_a_timed_call_keeps_the_inputs_it_converted() -> None:
    # inputs given in another dtype are converted once when the call is made: the call must hold
    # the converted copies (the kernel reads them through raw pointers), or it reads freed memory
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("L",))
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal((64, 48)), rng.standard_normal((48, 32))  # float64: converted
    op = graph.ops[0]
    call = executor.op_call(op, {"X": x, "W": w})
    expected = call().copy()
    del x, w
    litter = [np.full((64, 48), 7.0, np.float32) for _ in range(50)]  # reuses freed memory
    np.testing.assert_array_equal(call(), expected)
    assert litter[0][0, 0] == 7.0


@NEEDS_CC
def test_a_run_at_addresses_reads_and_writes_the_callers_memory() -> None:
    graph = neoflow.graph(CHAIN)
    executor = CpuExecutor(graph, keep=("T", "L"))
    assert executor.addressable and executor.input_names == ["X", "W"]
    assert [(name, shape) for name, shape, _ in executor.output_specs] == [("T", (64, 32)), ("L", ())]
    (inputs,) = _batches(3, 1)
    outputs = {name: np.full(shape, np.nan, dtype) for name, shape, dtype in executor.output_specs}
    addresses = [data_address(inputs[name]) for name in executor.input_names]
    executor.run_at(addresses, [data_address(outputs[name]) for name, _, _ in executor.output_specs])
    expected = executor.run(inputs)
    for name in ("T", "L"):
        np.testing.assert_array_equal(outputs[name], expected[name])
