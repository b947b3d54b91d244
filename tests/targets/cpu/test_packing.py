"""Operand packers that read through offset tables: which operands qualify, their ranges, and results."""

from __future__ import annotations

import pytest
import sympy

import neoflow
from neoflow.ir.expr import Binary
from neoflow.ir.index import var
from neoflow.targets.cpu.gemm import gemm_plan
from neoflow.targets.cpu.lower import lower_op
from neoflow.targets.cpu.packing import (
    Range,
    Strips,
    affine_operand,
    gather_fraction,
    gather_step,
    vector_fraction,
    vector_path,
    vector_runs,
)
from tests.on_targets import NEEDS_CC, assert_compiled_matches_interpreter

CONV = (
    "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 9 && q + s - 1 >= 0 && "
    "q + s - 1 < 9, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])"
)
CONV_SHAPES = {"X": (2, 16, 9, 9), "W": (32, 16, 3, 3), "Y": (2, 32, 9, 9)}


def _op(text: str, shapes: dict) -> neoflow.Op:
    """The op of ``text``; a ``Y`` entry of ``shapes`` is the output's shape."""
    shapes = dict(shapes)
    return neoflow.op(text, shapes=shapes, out_shape=shapes.pop("Y", None))


def _factors(text: str, shapes: dict) -> tuple:
    op = _op(text, shapes)
    product = op.body.body
    assert isinstance(product, Binary)
    return product.a, product.b, {t.name: t.shape for t in op.inputs}, op.extent


def test_a_padded_read_becomes_an_offset_and_two_ranges() -> None:
    padded, weight, shapes, extents = _factors(CONV, CONV_SHAPES)
    operand = affine_operand(padded, shapes, extents)
    p, q, r, s, n, c = (var(v) for v in "pqrsnc")
    assert operand is not None and operand.tensor == "X"
    assert sympy.expand(operand.offset - (n * 16 * 81 + c * 81 + (p + r - 1) * 9 + q + s - 1)) == 0
    assert set(operand.ranges) == {Range(p + r, 1, 9), Range(q + s, 1, 9)}
    plain = affine_operand(weight, shapes, extents)
    assert plain is not None and plain.ranges == ()


def test_one_sided_and_strict_bounds_are_normalised() -> None:
    text = "C[i, j] = ReduceAdd({k}, Select(k - i <= 3 && i + k > 2, A[i, k], 0) * B[k, j])"
    guarded, _, shapes, extents = _factors(text, {"A": (8, 8), "B": (8, 8)})
    operand = affine_operand(guarded, shapes, extents)
    i, k = var("i"), var("k")
    # k - i <= 3 is i - k >= -3 (first coefficient made positive); i + k > 2 is i + k >= 3
    assert operand is not None and set(operand.ranges) == {Range(i - k, -3, None), Range(i + k, 3, None)}


@pytest.mark.parametrize(
    "text",
    [
        "C[i, j] = ReduceAdd({k}, exp(A[i, k]) * B[k, j])",  # a prologue computing values
        "C[i, j] = ReduceAdd({k}, max(A[i, k], 1) * B[k, j])",  # a clamp that moves zero
        "C[i, j] = ReduceAdd({k}, max(A[i, k], -inf) * B[k, j])",  # not a finite C literal
        "C[i, j] = ReduceAdd({k}, Select(i > 2, A[i, k], 1) * B[k, j])",  # the other branch is not zero
        "C[i, j] = ReduceAdd({k}, Select(i % 2 == 0, A[i, k], 0) * B[k, j])",  # a guard that is not a bound
        "C[i, j] = ReduceAdd({k}, A[i, k // 2] * B[k, j])",  # a quasi-affine index
    ],
)
def test_other_operands_keep_the_generic_packer(text: str) -> None:
    operand, _, shapes, extents = _factors(text, {"A": (8, 8), "B": (8, 8)})
    assert affine_operand(operand, shapes, extents) is None


@NEEDS_CC
@pytest.mark.parametrize(
    ("text", "shapes"),
    [
        (CONV, CONV_SHAPES),
        (
            "C[n, i, j] = ReduceAdd({k}, Select(k - i <= 3 && i + k > 2, A[n, i, k], 0) * B[k, j])",
            {"A": (2, 40, 60), "B": (60, 50)},
        ),
        (
            "C[i, j] = ReduceAdd({k}, Select(k >= 5, A[k, i], 0) * Select(j + k < 70, B[j, k], 0))",
            {"A": (60, 40), "B": (50, 60)},
        ),
    ],
)
def test_table_packers_compute_what_the_interpreter_does(text: str, shapes: dict) -> None:
    op = _op(text, shapes)
    assert gemm_plan(op) is not None
    assert "int64_t *const *side" in lower_op(op, "kernel"), "the packers should read through offset tables"
    assert_compiled_matches_interpreter(op, 1)


@NEEDS_CC
def test_runs_of_a_padded_read_are_copied_whole_and_their_guards_hold_at_both_ends(narrower_cc) -> None:
    # narrower builds: 20-wide rows in 16-wide strips: runs inside a row, strips across rows, and runs
    # that start inside the image but end in its padding (they must not be copied whole)
    text = CONV.replace("< 9", "< 20")
    op = _op(text, {"X": (2, 8, 20, 20), "W": (16, 8, 3, 3), "Y": (2, 16, 20, 20)})
    source = lower_op(op, "kernel")
    assert "memcpy(strip" in source, "the packer should copy runs of consecutive reads whole"
    assert_compiled_matches_interpreter(op, 2)


@NEEDS_CC
@pytest.mark.parametrize(
    ("text", "shapes"),
    [
        # 20-wide rows in 16-wide strips of (p, q): strips across rows, lanes in the padding on
        # both sides, the first and last strips reaching outside X (masked loads)
        (CONV.replace("< 9", "< 20"), {"X": (2, 8, 20, 20), "W": (16, 8, 3, 3), "Y": (2, 16, 20, 20)}),
        # one-sided bounds on the column side (each lane checked against one end), a partial last strip
        (
            "C[i, j] = ReduceAdd({k}, A[i, k] * Select(j - k <= 3 && j + k > 2, B[k, j], 0))",
            {"A": (40, 60), "B": (60, 50)},
        ),
    ],
)
def test_vector_packer_masks_every_lane_that_fails_a_guard(text: str, shapes: dict) -> None:
    op = _op(text, shapes)
    source = lower_op(op, "kernel")
    assert "_mm256_maskload_ps" in source, "the column strips should be copied with vector loads"
    assert_compiled_matches_interpreter(op, 3)


# the channel innermost in the depth, as autodiff and the frontend order a conv's sum: the strips
# then run along the output columns
STRIDED = (
    "Y[n, k, p, q] = ReduceAdd({r, s, c}, Select(2*p + r - 1 >= 0 && 2*p + r - 1 < 32 && 2*q + s - 1 >= 0 && "
    "2*q + s - 1 < 32, X[n, c, 2*p + r - 1, 2*q + s - 1], 0) * W[k, c, r, s])"
)


STRIDED_CASES = [
    # a stride-2 padded conv: each 16-wide strip of (p, q) is one output row, read every other
    # element, its first lane in the padding where s = 0
    (STRIDED, {"X": (2, 4, 32, 32), "W": (16, 4, 3, 3), "Y": (2, 16, 16, 16)}),
    # without padding: every lane read; rows of 20 split across strips (those element by element);
    # the last strips' reads end less than 31 elements before the tensor's end (gathered)
    (
        "Y[n, k, p, q] = ReduceAdd({r, s, c}, X[n, c, 2*p + r, 2*q + s] * W[k, c, r, s])",
        {"X": (2, 4, 41, 41), "W": (16, 4, 3, 3), "Y": (2, 16, 20, 20)},
    ),
]


@NEEDS_CC
@pytest.mark.parametrize(("text", "shapes"), STRIDED_CASES)
def test_strided_strips_are_gathered_or_compacted_with_their_guards_as_the_mask(text: str, shapes: dict) -> None:
    op = _op(text, shapes)
    source = lower_op(op, "kernel")
    assert "_mm256_mask_i32gather_ps" in source, "strided strips should be gathered"
    assert "nf_load_pairs(in0 + at)" in source, "a step of two should be compacted on AVX-512"
    assert_compiled_matches_interpreter(op, 7)


@NEEDS_CC
@pytest.mark.parametrize(("text", "shapes"), STRIDED_CASES)
def test_on_narrower_vector_units_strided_strips_compute_the_same(text: str, shapes: dict, narrower_cc) -> None:
    assert_compiled_matches_interpreter(_op(text, shapes), 8)


def test_the_gathered_share_counts_the_strips_inside_one_strided_row() -> None:
    op = _op(STRIDED, {"X": (2, 4, 32, 32), "W": (16, 4, 3, 3), "Y": (2, 16, 16, 16)})
    operand = affine_operand(op.body.body.a, {t.name: t.shape for t in op.inputs}, op.extent)
    depth = ("r", "s", "c")

    def share(side: tuple, **extents: int) -> float:
        return gather_fraction(operand, 16, True, Strips(side, depth, {**op.extent, **extents}, 8192))

    assert share(("p", "q")) == 1.0  # rows of 16 read every other element: each strip is one row
    assert share(("q",), q=20) == 0.8  # one full strip of 20, the last 4 element by element
    assert share(("p", "q"), p=16, q=20) == 0.4  # strips across rows of 20: 2 of every 5 stay inside one
    unit = _op(CONV, CONV_SHAPES)
    padded = affine_operand(unit.body.body.a, {t.name: t.shape for t in unit.inputs}, unit.extent)
    assert gather_fraction(padded, 16, True, Strips(("p", "q"), depth, unit.extent, 8192)) == 0.0  # loads


def test_the_gathered_reads_step_is_the_last_side_variables_coefficient() -> None:
    depth = ("r", "s", "c")
    for stride in (2, 3):
        op = _op(STRIDED.replace("2*", f"{stride}*"), {"X": (2, 4, 48, 48), "W": (16, 4, 3, 3), "Y": (2, 16, 16, 16)})
        operand = affine_operand(op.body.body.a, {t.name: t.shape for t in op.inputs}, op.extent)
        assert gather_step(operand, Strips(("p", "q"), depth, op.extent, 18432)) == stride
    assert gather_step(None, Strips(("p", "q"), depth, op.extent, 18432)) == 0


def test_vector_runs_need_consecutive_reads_and_small_lanes() -> None:
    padded, _, shapes, extents = _factors(CONV, CONV_SHAPES)
    operand = affine_operand(padded, shapes, extents)
    extents = {"n": 2, "c": 16, "k": 32, "p": 9, "q": 9, "r": 3, "s": 3}
    assert vector_runs(operand, ("p", "q"), extents)  # row-major: q moves by 1, p by a row of 9
    assert vector_runs(operand, ("q",), extents)
    assert not vector_runs(operand, ("q", "p"), extents)  # p moves the read by 9
    assert not vector_runs(operand, ("p", "q"), {**extents, "q": 8})  # rows of 9 read 8 at a time
    assert not vector_runs(operand, ("p", "q"), {**extents, "p": 1 << 31})  # a guard beyond 32 bits


DEPTH_RUNS = [
    # rows read along the depth (A[i, k]): 67 rows = 11 strips of 6 and one left over, 300 steps = 37 runs of 8
    ("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", {"A": (67, 300), "B": (300, 37)}),
    # a padded weight gradient: the depth (n, p, q) reads runs of 13 along q, then jumps (rows of X are 15
    # wide, the next image is further on); lanes in the padding masked on both sides
    (
        "dW[k, c, r, s] = ReduceAdd({n, p, q}, dY[n, k, p, q] * Select(p + r - 1 >= 0 && p + r - 1 < 15 && "
        "q + s - 1 >= 0 && q + s - 1 < 13, X[n, c, p + r - 1, q + s - 1], 0))",
        {"dY": (3, 20, 15, 13), "X": (3, 5, 15, 15), "Y": (20, 5, 3, 3)},
    ),
]


# a padded capsule convolution: its depth (c, r, s, t) reads runs of four along a pose's last axis t,
# copied four steps at a time (the upper lanes masked off) by a side-outer packer
CAPSULE_RUNS = (
    "Y[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, Select(p + r - 1 >= 0 && p + r - 1 < 7 && q + s - 1 >= 0 && "
    "q + s - 1 < 7, X[b, c, p + r - 1, q + s - 1, i, t], 0) * W[k, c, r, s, t, j])"
)
CAPSULE_SHAPES = {"X": (4, 8, 7, 7, 4, 4), "W": (8, 8, 3, 3, 4, 4), "Y": (4, 8, 7, 7, 4, 4)}


def test_runs_of_four_along_the_depth_take_the_vector_path_of_a_side_outer_packer() -> None:
    padded, _, shapes, extents = _factors(CAPSULE_RUNS, CAPSULE_SHAPES)
    operand = affine_operand(padded, shapes, extents)
    strips = Strips(("b", "p", "q", "i"), ("c", "r", "s", "t"), extents, 4 * 8 * 7 * 7 * 16)
    assert vector_path(operand, 6, False, strips) == "depth"
    assert vector_fraction(operand, 6, False, strips) == 1.0  # every run of four a vector copy
    assert vector_path(operand, 16, True, strips) == "side"  # a side-inner packer keeps its strips' path


@NEEDS_CC
def test_runs_of_four_along_the_depth_are_copied_and_compute_the_same() -> None:
    op = _op(CAPSULE_RUNS, CAPSULE_SHAPES)
    source = lower_op(op, "kernel")
    assert "run4[p]" in source and "nf_transpose8(v)" in source
    assert_compiled_matches_interpreter(op, 7)


@NEEDS_CC
@pytest.mark.parametrize(("text", "shapes"), DEPTH_RUNS)
def test_depth_runs_are_transposed_in_registers(text: str, shapes: dict) -> None:
    op = _op(text, shapes)
    source = lower_op(op, "kernel")
    assert "nf_transpose8(v)" in source, "a packer should copy runs along the depth with vector loads"
    assert_compiled_matches_interpreter(op, 5)


@NEEDS_CC
@pytest.mark.parametrize(("text", "shapes"), DEPTH_RUNS)
def test_on_narrower_vector_units_the_packers_and_micro_kernel_compute_the_same(
    text: str, shapes: dict, narrower_cc
) -> None:
    assert_compiled_matches_interpreter(_op(text, shapes), 6)


@NEEDS_CC
def test_a_reshape_read_through_its_digits_is_packed_as_the_flat_read_it_is() -> None:
    # a flatten inlined into a matmul (the capsule network's f into its logits): the digits of j
    # over X's dimensions add back up to j, so the packer reads X as the plain matrix it is
    text = "Y[n, k] = ReduceAdd({j}, X[n, j//8 % 8, j//4 % 2, j//2 % 2, j % 2] * W[k, j])"
    shapes = {"X": (96, 8, 2, 2, 2), "W": (40, 64), "Y": (96, 40)}
    op = _op(text, shapes)
    digits, _, inputs, extents = _factors(text, shapes)
    operand = affine_operand(digits, inputs, extents)
    assert operand is not None and operand.offset == 64 * var("n") + var("j") and operand.ranges == ()
    assert "_pack_" in lower_op(op, "kernel")
    assert_compiled_matches_interpreter(op, 11)


RELU_CONV = (
    "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 9 && q + s - 1 >= 0 && "
    "q + s - 1 < 9, max(X[n, c, p + r - 1, q + s - 1], 0), 0) * W[k, c, r, s])"
)


def test_a_clamp_that_keeps_zero_is_part_of_the_affine_read() -> None:
    relu, _, shapes, extents = _factors(RELU_CONV, CONV_SHAPES)
    operand = affine_operand(relu, shapes, extents)
    assert operand is not None and operand.clamps == (("max", 0.0),) and len(operand.ranges) == 2
    text = "C[i, j] = ReduceAdd({k}, min(6, max(A[i, k], 0)) * B[k, j])"
    relu6, _, shapes, extents = _factors(text, {"A": (8, 8), "B": (8, 8)})
    operand = affine_operand(relu6, shapes, extents)
    assert operand is not None and operand.clamps == (("max", 0.0), ("min", 6.0))


@NEEDS_CC
@pytest.mark.parametrize(
    ("text", "shapes", "vector"),
    [
        # a ReLU inlined into a padded conv: column strips of (p, q) copied with vector loads, then clamped
        (RELU_CONV, CONV_SHAPES, "_mm256_max_ps"),
        # a clipped ReLU inlined into a matmul reading rows along the depth: 8-step runs loaded, clamped, transposed
        (
            "C[i, j] = ReduceAdd({k}, min(max(A[i, k], 0), 0.5) * B[k, j])",
            {"A": (70, 96), "B": (96, 50), "Y": (70, 50)},
            "_mm256_min_ps",
        ),
    ],
)
def test_a_clamped_operand_is_packed_with_its_clamp(text: str, shapes: dict, vector: str) -> None:
    op = _op(text, shapes)
    source = lower_op(op, "kernel")
    assert "_pack_" in source and vector in source, "the clamp should be applied to the vector loads"
    assert_compiled_matches_interpreter(op, 13)
