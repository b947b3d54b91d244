"""GEMM chains tiled together (Chimera): matching, tile choice, and the kernel's results."""

from __future__ import annotations

import numpy as np
import pytest

import neoflow
from neoflow.targets.cpu.chain import chain_plan, choose_tiles, data_movement, footprint
from neoflow.targets.cpu.gemm import KC
from neoflow.targets.cpu.lower import lower_op
from tests.on_targets import NEEDS_CC

CHAIN = "E[i, n] = ReduceAdd({l}, ReduceAdd({k}, A[i, k] * B[k, l]) * D[l, n])"
# the same chain with every operand transposed and the output written as [n, i]
TRANSPOSED = "E[n, i] = ReduceAdd({l}, Dt[n, l] * ReduceAdd({k}, Bt[l, k] * At[k, i]))"


def _shapes(m: int, n: int, l: int, k: int, transposed: bool = False) -> dict:  # noqa: E741
    if transposed:
        return {"At": (k, m), "Bt": (l, k), "Dt": (n, l)}
    return {"A": (m, k), "B": (k, l), "D": (l, n)}


def test_a_gemm_chain_is_matched_in_either_layout() -> None:
    plan = chain_plan(neoflow.op(CHAIN, shapes=_shapes(1024, 64, 1024, 64)), threads=2)
    assert plan is not None
    assert (plan.row, plan.col, plan.middle, plan.depth) == ("i", "n", "l", "k")
    assert plan.extents == (1024, 64, 1024, 64)
    flipped = chain_plan(neoflow.op(TRANSPOSED, shapes=_shapes(300, 40, 200, 50, True)), threads=2)
    assert flipped is not None and (flipped.row, flipped.col) == ("i", "n")
    assert "GEMM chain" in lower_op(neoflow.op(CHAIN, shapes=_shapes(1024, 64, 1024, 64)), "kernel")


@pytest.mark.parametrize(
    "text",
    [
        "E[i, n] = ReduceAdd({l}, ReduceAdd({k}, A[i, k] * B[k, l]) + D[l, n])",  # not a product
        "E[i, n] = ReduceAdd({l}, ReduceAdd({k}, A[i, k] * B[k, n]) * D[l, n])",  # inner sum reads the column
        "E[i, n] = ReduceMax({l}, ReduceAdd({k}, A[i, k] * B[k, l]) * D[l, n])",  # not a sum
    ],
)
def test_other_nested_reductions_are_not_chains(text: str) -> None:
    shapes = {"A": (64, 64), "B": (64, 64), "D": (64, 64)}
    assert chain_plan(neoflow.op(text, shapes=shapes)) is None


def test_tiles_minimise_data_movement_within_the_cache() -> None:
    capacity = 512 * 1024
    m, n, l, k = 1024, 64, 1024, 64  # noqa: E741
    tile_m, tile_l = choose_tiles(m, n, l, k, cache_bytes=capacity, threads=2)
    assert tile_m % 16 == 0 and tile_l % 6 == 0
    assert footprint(n, k, tile_m, tile_l) * 4 <= capacity
    chosen = data_movement(m, n, l, k, tile_m, tile_l)
    # no other admissible tiling moves less, and the chosen one beats storing C (2 M L extra elements)
    for other_m in range(16, 257, 16):
        for other_l in range(6, 1027, 6):
            if footprint(n, k, other_m, other_l) * 4 <= capacity and (1024 // other_m) % 2 == 0:
                assert chosen <= data_movement(m, n, l, k, other_m, other_l)
    assert chosen < m * k + k * l + l * n + m * n + 2 * m * l
    # a smaller cache gives smaller tiles
    small_m, small_l = choose_tiles(m, n, l, k, cache_bytes=64 * 1024, threads=2)
    assert footprint(n, k, small_m, small_l) * 4 <= 64 * 1024 and small_m * small_l < tile_m * tile_l


def test_with_all_of_l_in_one_block_b_and_d_move_once_per_thread() -> None:
    m, n, l, k = 1024, 64, 1024, 64  # noqa: E741
    once = m * k + 2 * (k + n) * l + m * n  # A and E once; B and D once into each of two threads' caches
    assert data_movement(m, n, l, k, 16, 1026, threads=2) == once
    assert data_movement(m, n, l, k, 256, 1026, threads=2) == once
    assert data_movement(m, n, l, k, 256, 516, threads=2) > once  # two blocks of l: B and D per row block
    # on a 2 MiB cache all of l fits; of the tilings that move as little, the smallest footprint
    tile_m, tile_l = choose_tiles(m, n, l, k, cache_bytes=2 * 1024 * 1024, threads=2)
    assert tile_l >= l and tile_m == 16


def _assert_chain_matches_interpreter(text: str, sizes: tuple, transposed: bool = False, seed: int = 1) -> None:
    shapes = _shapes(*sizes, transposed)
    op = neoflow.op(text, shapes=shapes)
    assert chain_plan(op) is not None
    rng = np.random.default_rng(seed)
    inputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    compiled = neoflow.compile(op, target="cpu").run(inputs)
    expected = neoflow.compile(op, target="interp").run(inputs)
    np.testing.assert_allclose(compiled, expected, rtol=1e-4, atol=1e-3)


@NEEDS_CC
@pytest.mark.parametrize(
    ("text", "sizes", "transposed"),
    [(CHAIN, (70, 20, 100, 40), False), (TRANSPOSED, (53, 13, 97, 61), True), (CHAIN, (256, 64, 192, 48), False)],
)
def test_the_chain_kernel_computes_what_the_interpreter_does(text: str, sizes: tuple, transposed: bool) -> None:
    _assert_chain_matches_interpreter(text, sizes, transposed)


@NEEDS_CC
def test_a_tile_of_l_deeper_than_a_depth_block_is_summed_block_by_block() -> None:
    # the second product runs over KC values of l at a time (two whole blocks and a rest here)
    sizes = (96, 20, 600, 24)
    plan = chain_plan(neoflow.op(CHAIN, shapes=_shapes(*sizes)))
    assert plan is not None and plan.tile_l > 2 * KC
    _assert_chain_matches_interpreter(CHAIN, sizes, seed=3)


@NEEDS_CC
def test_on_narrower_vector_units_the_chain_kernel_computes_the_same(narrower_cc) -> None:
    # the narrower builds' micro-kernels, the accumulating one over the blocks of L (TL = 6
    # for these sizes on 2 threads)
    _assert_chain_matches_interpreter(CHAIN, (70, 20, 100, 40), seed=2)
