"""The blocked outer-product kernel: contractions with odd sizes, guards, batches and epilogues."""

from __future__ import annotations

import numpy as np
import pytest
import sympy

import neoflow
from neoflow.codegen.hardware import cpu_flags
from neoflow.targets.cpu import gemm, tuning
from neoflow.targets.cpu.gemm import GATHER_PACK_CYCLES, STEP_CYCLES, VECTOR_PACK_CYCLES, blocked_form, gemm_plan
from neoflow.targets.cpu.lower import KernelChoice, lower_op, lowering_paths
from neoflow.targets.cpu.prelude import PARALLEL_MIN_POINTS
from tests.on_targets import NEEDS_CC, assert_compiled_matches_interpreter, compiler_defines

pytestmark = NEEDS_CC

CASES = {
    "gemm_odd": ("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", {"A": (67, 300), "B": (300, 37)}),
    # an odd depth (256 + 45): the AVX-512 micro-kernel's depth steps go in pairs, the last one alone
    "gemm_odd_depth": ("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", {"A": (37, 301), "B": (301, 29)}),
    "gemm_transposed_b_bias": (
        "C[i, j] = ReduceAdd({k}, A[i, k] * W[j, k]) + Bias[j]",
        {"A": (50, 70), "W": (33, 70), "Bias": (33,)},
    ),
    "batched": ("C[g, i, j] = ReduceAdd({k}, A[g, i, k] * B[g, k, j])", {"A": (3, 20, 40), "B": (3, 40, 18)}),
    "conv_padded_bias": (
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 9 && q + s - 1 >= 0 && "
        "q + s - 1 < 9, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s]) + Bias[k]",
        {"X": (2, 16, 9, 9), "W": (32, 16, 3, 3), "Bias": (32,), "Y": (2, 32, 9, 9)},
    ),
    "conv_input_adjoint_with_domain": (
        "dX[n, c, z3, z4] = ReduceAdd({k, r, s | z3 - r >= -1 && z3 - r < 8 && z4 - s >= -1 && z4 - s < 8}, "
        "dY[n, k, z3 - r + 1, z4 - s + 1] * W[k, c, r, s])",
        {"dY": (2, 32, 9, 9), "W": (32, 16, 3, 3), "Y": (2, 16, 9, 9)},
    ),
    "strided_adjoint_lattice": (
        "dX[c, z] = ReduceAdd({k, r | (z - r) % 2 == 0 && (z - r) // 2 >= 0 && (z - r) // 2 < 200}, "
        "dY[k, (z - r) // 2] * W[k, c, r])",
        {"dY": (16, 200), "W": (16, 16, 3), "Y": (16, 401)},
    ),
    # small outputs with long reductions (weight gradients): the reduction is shared out among the threads
    "weight_gradient_split_depth": (
        "dW[k, c, r, s] = ReduceAdd({n, p, q}, dY[n, k, p, q] * X[n, c, p + r, q + s])",
        {"dY": (4, 20, 30, 30), "X": (4, 3, 32, 32)},
    ),
    "split_depth_bias": (
        "C[i, j] = ReduceAdd({k}, A[k, i] * B[k, j]) + Bias[j]",
        {"A": (3000, 30), "B": (3000, 50), "Bias": (50,)},
    ),
    # vectorised along the depth (``depth_vector``): a step of two along q (and a 5-step tail),
    # a batch variable outside, both operands stepping by two, and an update epilogue
    "weight_gradient_stride_2": (
        "dW[k, c, r, s] = ReduceAdd({n, p, q}, dY[n, k, p, q] * X[n, c, 2*p + r, 2*q + s])",
        {"dY": (2, 10, 16, 37), "X": (2, 3, 33, 75)},
    ),
    "batched_weight_gradient": (
        "dW[g, k, c] = ReduceAdd({p, q}, dY[g, k, p, q] * X[g, c, 2*p, 2*q])",
        {"dY": (3, 7, 8, 160), "X": (3, 5, 16, 320)},
    ),
    "both_operands_step_two": (
        "dW[k, c] = ReduceAdd({p, q: 64}, dY[k, p, 2*q] * X[c, p, 2*q + 1])",
        {"dY": (9, 20, 128), "X": (11, 20, 129)},
    ),
    "depth_vector_update_epilogue": (
        "C[k, c] = P[k, c] - 0.1 * ReduceAdd({p, q}, dY[k, p, q] * X[c, p, 2*q])",
        {"dY": (13, 20, 64), "X": (7, 20, 128), "P": (13, 7)},
    ),
    # the step of two on the rows' side (their block the inner loop), depth blocks of 32 outer
    # points and a shorter last one in each thread's share
    "depth_vector_step_two_rows": (
        "dW[c, k] = ReduceAdd({p, q}, X[c, p, 2*q] * dY[k, p, q])",
        {"X": (5, 80, 128), "dY": (9, 80, 64)},
    ),
    # epilogues of any shape, applied to the finished sum (what fusing an activation or an update gives)
    "relu_bias_epilogue": (
        "C[i, j] = max(ReduceAdd({k}, A[i, k] * B[k, j]) + Bias[j], 0)",
        {"A": (40, 70), "B": (70, 35), "Bias": (35,)},
    ),
    "sgd_update_epilogue_split_depth": (
        "C[i, j] = P[i, j] - 0.1 * ReduceAdd({k}, A[k, i] * B[k, j])",
        {"A": (3000, 30), "B": (3000, 50), "P": (30, 50)},
    ),
    # an epilogue reading a column variable: in vector lanes along runs of the innermost column
    # (16 and a tail of 4 a row of 20; in rows of 9, a strip crossing two is finished element by element)
    "conv_residual_epilogue": (
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, p + r, q + s] * W[k, c, r, s]) + R[n, k, p, q]",
        {"X": (2, 8, 22, 22), "W": (24, 8, 3, 3), "R": (2, 24, 20, 20)},
    ),
    "conv_residual_epilogue_short_rows": (
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 9 && q + s - 1 >= 0 && "
        "q + s - 1 < 9, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s]) + R[n, k, p, q] * q",
        {"X": (2, 16, 9, 9), "W": (32, 16, 3, 3), "R": (2, 32, 9, 9), "Y": (2, 32, 9, 9)},
    ),
    # a 1x1 convolution's bias and clamp over 8x8 images: a strip of 16 columns spans two image rows
    "pointwise_bias_clamp_8x8": (
        "Y[n, k, p, q] = min(max(ReduceAdd({c}, X[n, c, p, q] * W[k, c]) + Bias[k], 0), 6)",
        {"X": (2, 24, 8, 8), "W": (40, 24), "Bias": (40,)},
    ),
    # the output transposed: the columns step it by more than one, every tile element by element
    "transposed_output_epilogue": (
        "C[j, i] = ReduceAdd({k}, A[i, k] * B[k, j]) + R[j, i]",
        {"A": (40, 70), "B": (70, 35), "R": (35, 40)},
    ),
    # two depth blocks (600 > KC) into tiles stored element by element: the last one adds the first's
    # sums and finishes the element from the micro-kernel's tile
    "transposed_output_relu_long_depth": (
        "C[j, i] = max(ReduceAdd({k}, A[i, k] * B[k, j]) + R[j, i], 0)",
        {"A": (100, 600), "B": (600, 35), "R": (35, 100)},
    ),
    "guarded_epilogue_crop": (
        "C[i, j] = Select(i > 2 && j > 0, ReduceAdd({k}, A[i, k] * B[k, j]), 0)",
        {"A": (40, 70), "B": (70, 35)},
    ),
    "triangular": ("C[i, j] = ReduceAdd({k | k <= i}, A[i, k] * B[k, j])", {"A": (64, 64), "B": (64, 64)}),
    "capsule_stride_2": (
        "Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In0[b, c, p*2 + r, q*2 + s, i, t] * In1[k, c, r, s, t, j])",
        {"In0": (2, 3, 9, 9, 4, 4), "In1": (5, 3, 3, 3, 4, 4)},
    ),
}


def case_op(case: str):
    """The op of ``CASES[case]`` (its output's shape given where the case names ``Y``)."""
    text, shapes = CASES[case]
    inputs = {name: shape for name, shape in shapes.items() if name != "Y"}
    return neoflow.op(text, shapes=inputs, out_shape=shapes.get("Y"))


@pytest.mark.parametrize("case", list(CASES))
def test_blocked_kernel_matches_the_interpreter(case: str) -> None:
    op = case_op(case)
    assert gemm_plan(op) is not None, "the op should take the blocked kernel"
    assert_compiled_matches_interpreter(op, 0)


@pytest.mark.parametrize(
    ("case", "condition"),
    [
        # the columns step the output by one: any run of the innermost column, a short last strip too
        ("conv_residual_epilogue", "if (col_tab[(jc + jr) * 1 + 0] + width <= 20)"),
        ("conv_residual_epilogue_short_rows", "if (col_tab[(jc + jr) * 2 + 1] + width <= 9)"),
        # they step it by 35: only a full strip whose columns the output holds together
        ("transposed_output_epilogue", "if (dense && width == 16 && col_tab[(jc + jr) * 1 + 0] + width <= 35)"),
    ],
)
def test_epilogues_are_finished_in_vector_lanes_along_runs_of_the_innermost_column(case: str, condition: str) -> None:
    lanes = lower_op(case_op(case), "kernel").split(condition, 1)[1].split("} else", 1)[0]
    assert "#pragma omp simd" in lanes and "first_ + jj;" in lanes and "const float acc_ = to[jj];" in lanes


@pytest.mark.parametrize("case", ["transposed_output_epilogue", "transposed_output_relu_long_depth"])
def test_a_tile_stored_element_by_element_is_finished_as_it_is_stored(case: str) -> None:
    # the epilogue reads the micro-kernel's tile (and the earlier depth blocks' sums), not the output back
    code = lower_op(case_op(case), "kernel")
    tile_branch = code.split("nf_micro_6x16(kc,", 1)[1]
    finishing, storing = tile_branch.split("if (pc == 0)", 1)
    assert "const float acc_ = (pc == 0 ? 0.0f : to[col_off[jc + jr + jj]]) + tile[ii * 16 + jj];" in finishing
    assert "const float acc_ = (pc == 0 ? 0.0f : to[jj]) + tile[ii * 16 + jj];" in finishing
    assert "acc_" not in storing.split("nf_micro_6x16", 1)[0]


@pytest.mark.parametrize(("case", "run"), [("conv_padded_bias", 9), ("pointwise_bias_clamp_8x8", 8)])
def test_an_epilogue_reading_no_column_variable_counts_none_up_in_its_lanes(case: str, run: int) -> None:
    # a bias by output channel: a strip whose columns lie together in the output (dense), or a run of the
    # innermost column (a short last strip), is finished in vector lanes, whichever image rows it spans
    code = lower_op(case_op(case), "kernel")
    lanes = code.split(f"if (dense || col_tab[(jc + jr) * 2 + 1] + width <= {run})", 1)[1].split("} else", 1)[0]
    assert "#pragma omp simd" in lanes and "first_" not in lanes


def test_an_epilogue_reading_a_column_variable_still_needs_a_run() -> None:
    code = lower_op(case_op("conv_residual_epilogue_short_rows"), "kernel")
    assert "if (col_tab[(jc + jr) * 2 + 1] + width <= 9)" in code and "dense ||" not in code


def test_small_non_float32_and_unfoldable_conditions_use_the_generic_loops() -> None:
    small = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (4, 4), "B": (4, 4)})
    double = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (64, 64), "B": (64, 64)}, dtype="float64"
    )
    masked = neoflow.op(
        "C[i, j] = ReduceAdd({k | i + j < 64}, A[i, k] * B[k, j])", shapes={"A": (64, 64), "B": (64, 64)}
    )
    assert gemm_plan(small) is None and gemm_plan(double) is None and gemm_plan(masked) is None


def test_parity_domains_are_blocked_only_on_their_dense_piece() -> None:
    # the four-op graph's dilated stride-2 conv: its input adjoint touches one point in four; the
    # blocked kernel runs on the even-even lattice piece alone and the other three are zero-filled
    op = neoflow.op(
        "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
        shapes={"B": (1, 3, 68, 68), "C": (64, 3, 3, 3)},
    )
    assert gemm_plan(op) is not None
    plan = gemm_plan(neoflow.grad(op)["B"])
    mapped = [piece for piece, mapping in plan.pieces if mapping is not None]
    assert len(plan.pieces) == 3 and len(mapped) == 1
    assert mapped[0].base == 0 and sorted(mapped[0].strides.values()) == [2, 136, 4624, 13872]


@pytest.mark.parametrize(("side", "parallel"), [(68, False), (160, True)])
def test_zero_filled_pieces_share_out_their_stores_where_the_whole_output_would(side: int, parallel: bool) -> None:
    # each zero piece is a third of the output at most: at side 160 it is below the points that
    # start threads (12800) while the output (51200) is not
    op = neoflow.op(
        "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
        shapes={"B": (1, 2, side, side), "C": (32, 2, 3, 3)},
    )
    adjoint = neoflow.grad(op)["B"]
    plan = gemm_plan(adjoint)
    zeros = [piece for piece, mapping in plan.pieces if mapping is None]
    assert zeros and all(piece.op.output.size < PARALLEL_MIN_POINTS for piece in zeros)
    code = gemm.gemm_function(adjoint, plan, "kernel")
    stores = [block for block in code.split("/* piece at offset")[1:] if "= 0.0f;" in block.split("}")[0]]
    assert len(stores) == len(zeros)
    # shared out unconditionally, or not a region at all (under a false if() it is still a team of one)
    assert all(("#pragma omp parallel for" in block.split("}")[0]) == parallel for block in stores)
    assert not any("if(" in block.split("}")[0] for block in stores)


def test_weight_gradients_share_out_the_reduction() -> None:
    assert "partial" in lower_op(case_op("weight_gradient_split_depth"), "kernel")
    assert "partial" not in lower_op(case_op("gemm_odd"), "kernel")


DEPTH_VECTOR_CASES = [
    "weight_gradient_split_depth",
    "weight_gradient_stride_2",
    "batched_weight_gradient",
    "both_operands_step_two",
    "depth_vector_update_epilogue",
    "depth_vector_step_two_rows",
]
DEPTH_VECTOR_MARK = "16 partial sums an output in lanes"


@pytest.mark.parametrize("case", DEPTH_VECTOR_CASES)
def test_long_depths_with_runs_of_one_or_two_steps_are_vectorised_along_the_depth(case: str) -> None:
    assert DEPTH_VECTOR_MARK in lower_op(case_op(case), "kernel")


@pytest.mark.parametrize(
    "text, shapes",
    [
        # a padding guard on the read, a step of three, a depth's last variable shorter than 16
        (
            "dW[k, c, r] = ReduceAdd({p, q}, dY[k, p, q] * Select(q + r - 1 >= 0, X[c, p, q + r - 1], 0))",
            {"dY": (8, 20, 64), "X": (5, 20, 64)},
        ),
        ("dW[k, c] = ReduceAdd({p, q}, dY[k, p, q] * X[c, p, 3*q])", {"dY": (8, 20, 64), "X": (5, 20, 192)}),
        ("dW[k, c] = ReduceAdd({p, q}, dY[k, p, q] * X[c, p, q])", {"dY": (8, 200, 8), "X": (5, 200, 8)}),
    ],
)
def test_other_long_depths_keep_the_packed_depth_split(text: str, shapes: dict) -> None:
    op = neoflow.op(text, shapes=shapes)
    code = lower_op(op, "kernel")
    assert "partial" in code and DEPTH_VECTOR_MARK not in code
    assert_compiled_matches_interpreter(op, 4)


def test_on_narrower_vector_units_the_depth_split_computes_the_same(narrower_cc) -> None:
    # without AVX-512 the packed depth split runs instead of the depth-vectorised kernel
    for case in ("weight_gradient_stride_2", "depth_vector_update_epilogue"):
        assert_compiled_matches_interpreter(case_op(case), 5)


def test_a_strided_adjoint_runs_the_blocked_kernel_on_each_dense_piece() -> None:
    op = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, 2*p + r, 2*q + s] * W[k, c, r, s])",
        shapes={"X": (2, 32, 33, 33), "W": (32, 32, 3, 3)},
    )
    plan = gemm_plan(neoflow.grad(op)["X"])
    lines = plan.describe().splitlines()
    # one piece per (row parity, column parity), each a dense contraction on the outer product
    assert [line.split(",", 1)[0] for line in lines] == ["offset 0", "offset 1", "offset 33", "offset 34"]
    # the depth: k and the kernel offsets of the piece's parity, those with one value dropped
    depths = [line.split("k<-(", 1)[1].split(")", 1)[0] for line in lines]
    assert all("outer_product: " in line for line in lines)
    assert depths == ["k, r_, s_", "k, r_", "k, s_", "k"]


def test_a_short_depth_stores_whole_rows_of_the_output() -> None:
    # the four-op graph's dilated convolution: 27 terms per output point; with the output
    # channels as the tile's columns every tile would be stored element by element
    op = neoflow.op(
        "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
        shapes={"B": (1, 3, 68, 68), "C": (64, 3, 3, 3)},
    )
    ((_, mapping),) = gemm_plan(op).pieces
    assert dict(mapping.axes)["j"][-1] == "q" and "k" in dict(mapping.axes)["i"]


def test_few_rows_pack_all_of_a_once_and_each_task_a_column_strip() -> None:
    narrow = "the whole of a (rows x depth) packed once"
    conv = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, p + r, q + s] * W[k, c, r, s])",
        shapes={"X": (3, 16, 12, 12), "W": (20, 16, 3, 3)},
    )
    assert narrow in lower_op(conv, "kernel")
    # a batched product whose rows change with the batch, and one whose rows are too many, keep the blocks
    batched = neoflow.op(
        "C[b, i, j] = ReduceAdd({k}, A[b, i, k] * B[b, k, j])", shapes={"A": (4, 20, 64), "B": (4, 64, 70)}
    )
    tall = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (300, 64), "B": (64, 200)})
    # ... but a shallow one (a MobileNetV2 1x1 expansion: 144 output channels over 24) packs all its rows
    expansion = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c}, X[n, c, p, q] * W[k, c])", shapes={"X": (2, 24, 8, 8), "W": (144, 24)}
    )
    assert narrow in lower_op(expansion, "kernel")
    for op in (conv, batched, tall, expansion):
        if op not in (conv, expansion):
            assert narrow not in lower_op(op, "kernel")
        assert_compiled_matches_interpreter(op, 4)


@pytest.mark.parametrize(
    ("columns", "depth", "together"),
    [
        (549, 64, 4),  # 35 strips: 8 tasks of four, the last of three, its last strip 5 wide
        (200, 64, 1),  # 13 strips: too few to share out in fours
        (549, 600, 1),  # four strips of depth 600 would not stay in the core's first cache
    ],
)
def test_a_task_of_the_narrow_kernel_packs_neighbouring_column_strips_together(
    columns: int, depth: int, together: int
) -> None:
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (20, depth), "B": (depth, columns)})
    source = lower_op(op, "kernel")
    assert "the whole of a (rows x depth) packed once" in source
    assert f"a task packs {together} column strip(s) together" in source
    # the packer copies the plain strips depth step by depth step, all of a task's strips in each
    assert "the plain strips" in source
    assert_compiled_matches_interpreter(op, 5)


def test_a_task_reads_a_column_strip_where_it_lies_when_its_reads_keep_inside_the_tensor_and_guards() -> None:
    # a padded 3x3 convolution of 48-wide rows, a task a strip (depth 576): the strip of columns
    # 16-31 of an inner row is read from X in place, the strips at the padding packed (with zeros)
    guards = "p + r - 1 >= 0 && p + r - 1 < 32 && q + s - 1 >= 0 && q + s - 1 < 48"
    text = f"Y[n, k, p, q] = ReduceAdd({{c, r, s}}, Select({guards}, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])"
    conv = neoflow.op(text, shapes={"X": (1, 64, 32, 48), "W": (16, 64, 3, 3)}, out_shape=(1, 16, 32, 48))
    source = lower_op(conv, "kernel")
    assert "a task packs 1 column strip(s) together" in source
    assert "direct_ = in0 + at_" in source and "nf_micro_6x16_rows_to(kc" in source
    assert_compiled_matches_interpreter(conv, 6)
    # a ReLU read inside the product clamps what a packed strip holds: such an operand is always packed
    clamped = neoflow.op(
        text.replace("X[n, c, p + r - 1, q + s - 1], 0)", "max(X[n, c, p + r - 1, q + s - 1], 0), 0)"),
        shapes={"X": (1, 64, 32, 48), "W": (16, 64, 3, 3)},
        out_shape=(1, 16, 32, 48),
    )
    assert "direct_" not in lower_op(clamped, "kernel")


def test_a_batch_of_small_outputs_with_long_depths_runs_narrow_not_depth_split() -> None:
    # a 3x3 convolution over 128 channels of 8x8 images: each image's output is small and its depth
    # long, which alone would share the depth out; over a batch the tasks are the images' column strips
    guards = "p + r - 1 >= 0 && p + r - 1 < 8 && q + s - 1 >= 0 && q + s - 1 < 8"
    text = f"Y[n, k, p, q] = ReduceAdd({{c, r, s}}, Select({guards}, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])"
    conv = neoflow.op(text, shapes={"X": (2, 128, 8, 8), "W": (16, 128, 3, 3)}, out_shape=(2, 16, 8, 8))
    source = lower_op(conv, "kernel")
    assert "the whole of a (rows x depth) packed once" in source and "partial" not in source
    assert_compiled_matches_interpreter(conv, 8)
    # one image: too few column strips to share out, the depth is shared out
    alone = neoflow.op(text, shapes={"X": (1, 128, 8, 8), "W": (16, 128, 3, 3)}, out_shape=(1, 16, 8, 8))
    assert "partial" in lower_op(alone, "kernel")


def test_a_deep_column_strip_is_multiplied_in_depth_blocks_that_stay_in_the_first_cache() -> None:
    # a padded 3x3 convolution over 64 channels with its bias and ReLU: depth 576 in three blocks of 192,
    # each multiplied by every row strip before the next; the epilogue after the last; 20 columns (the
    # strips of 16 and of 4 at each row's end) and the padding's packed strips take the tile's path
    guards = "p + r - 1 >= 0 && p + r - 1 < 6 && q + s - 1 >= 0 && q + s - 1 < 20"
    text = (
        f"Y[n, k, p, q] = max(ReduceAdd({{c, r, s}}, Select({guards}, X[n, c, p + r - 1, q + s - 1], 0) * "
        "W[k, c, r, s]) + Bias[k], 0)"
    )
    shapes = {"X": (2, 64, 6, 20), "W": (22, 64, 3, 3), "Bias": (22,)}
    conv = neoflow.op(text, shapes=shapes, out_shape=(2, 22, 6, 20))
    source = lower_op(conv, "kernel")
    assert "the whole of a (rows x depth) packed once" in source
    assert "for (int64_t block_ = 0; block_ < 576; block_ += 192)" in source
    assert "apack + ir * 576 + pc * 6" in source and "bpack + (jr - j0) * 576 + pc * 16" in source
    assert_compiled_matches_interpreter(conv, 7)
    # a depth of one block keeps the single pass
    shallow_shapes = {**shapes, "X": (2, 16, 6, 20), "W": (22, 16, 3, 3)}
    shallow = neoflow.op(text, shapes=shallow_shapes, out_shape=(2, 22, 6, 20))
    assert "block_" not in lower_op(shallow, "kernel")


def test_the_cost_model_counts_the_micro_kernel_the_build_runs() -> None:
    # the kernels are built for this machine: with AVX-512 the micro-kernel's zmm branch runs and a
    # depth step costs 3 cycles in the model, else 6 (the AVX2 or portable branch; elsewhere than
    # x86 neither the compiler's macro nor the flag is there)
    wide = compiler_defines("__AVX512F__")
    assert ("avx512f" in cpu_flags()) == wide
    assert (3.0 if wide else 6.0) == STEP_CYCLES


@pytest.mark.parametrize(
    ("stride", "avx512", "cycles"),
    [(2, True, VECTOR_PACK_CYCLES), (2, False, GATHER_PACK_CYCLES), (3, True, GATHER_PACK_CYCLES)],
)
def test_a_strip_read_every_other_element_is_priced_as_the_packer_copies_it(
    stride: int, avx512: bool, cycles: float, monkeypatch
) -> None:
    # rows of 16 outputs read `stride` apart: every strip gathered, or with AVX-512 and a step
    # of two compacted by two loads and a permute (about a vector copy)
    op = neoflow.op(
        f"Y[n, k, p, q] = ReduceAdd({{r, s, c}}, X[n, c, {stride}*p + r, {stride}*q + s] * W[k, c, r, s])",
        shapes={"X": (1, 4, 16 * stride + 2, 16 * stride + 2), "W": (8, 4, 3, 3)},
    )
    monkeypatch.setattr(gemm, "AVX512", avx512)
    gemm._operand_pack_cycles.cache_clear()
    try:
        price = gemm._pack_cycles(op, op.body.body.a, ("p", "q"), ("r", "s", "c"), 16)
    finally:
        gemm._operand_pack_cycles.cache_clear()
    assert price == cycles


@pytest.mark.parametrize(
    ("text", "shapes"),
    [
        # ShuffleNet's 1x1 grouped convolution (4 groups of 24), a BatchNorm and ReLU after it
        (
            "Y[n, k, p, q] = max(ReduceAdd({c}, X[n, c + 24*(k//24), p, q] * W[k, c]) * S[k] + B[k], 0)",
            {"X": (2, 96, 7, 7), "W": (96, 24), "S": (96,), "B": (96,)},
        ),
        # a 3x3 grouped convolution, 2 groups of 16, padded
        (
            "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r >= 1 && p + r <= 8 && q + s >= 1 && q + s <= 8, "
            "X[n, c + 16*(k//16), p + r - 1, q + s - 1], 0) * W[k, c, r, s])",
            {"X": (2, 32, 8, 8), "W": (32, 16, 3, 3), "Y": (2, 32, 8, 8)},
        ),
    ],
)
def test_a_grouped_convolution_runs_the_blocked_kernel_once_its_groups_are_split(text: str, shapes: dict) -> None:
    out_shape = shapes.pop("Y", None)
    op = neoflow.op(text, shapes=shapes, out_shape=out_shape)
    assert gemm_plan(op) is None  # k // 24 in a read: no affine map
    grouped, plan = gemm.blocked_form(op)
    assert grouped.indices[1:3] == ("k_group", "k_in_group") and grouped.output.size == op.output.size
    assert not any(atom for r in grouped.body.reads() for i in r.indices for atom in i.atoms(sympy.floor))
    assert plan is not None and "nf_micro_6x16" in lower_op(op, "kernel")
    assert_compiled_matches_interpreter(op, 3)


def test_two_operands_read_from_one_tensor_run_on_the_blocked_kernel() -> None:
    """Attention's scores from one qkv tensor: ``T[0, b, i, k] * T[1, b, j, k]``; the second operand is
    read under an alias (the mapper tells operands by tensor), the kernel given the tensor for both."""
    scores = neoflow.op(
        "S[b, i, j] = ReduceAdd({k}, T[0, b, i, k] * T[1, b, j, k]) * 0.25", shapes={"T": (3, 4, 40, 16)}
    )
    assert blocked_form(scores) is not None and "blocked" in lowering_paths(scores)
    assert "_b(out, in0, in0)" in lower_op(scores, "kernel")
    assert_compiled_matches_interpreter(scores, 6)


BATCHED = "each thread whole batch items"


def test_many_small_products_of_a_batch_each_go_to_one_thread_whole() -> None:
    # attention's products per head (a 4-head 65-token block at batch 2), with an epilogue: batched
    heads = neoflow.op(
        "S[b, h, i, j] = ReduceAdd({d}, Q[b, h, i, d] * K[b, h, j, d]) * 0.125 + M[i, j]",
        shapes={"Q": (2, 4, 65, 32), "K": (2, 4, 65, 32), "M": (65, 65)},
    )
    assert BATCHED in lower_op(heads, "kernel")
    # a grouped convolution's input adjoint (the dX point's channel within its group solved): batched
    grouped = neoflow.op(
        "Y[n, k, h, w] = ReduceAdd({c, r, s}, Select(h + r >= 1 && h + r <= 8 && w + s >= 1 && w + s <= 8, "
        "X[n, (k // 8) * 8 + c, h + r - 1, w + s - 1], 0) * W[k, c, r, s])",
        shapes={"X": (2, 32, 8, 8), "W": (32, 8, 3, 3), "Y": (2, 32, 8, 8)},
    )
    (adjoint,) = [a for name, a in neoflow.grad(grouped).items() if name == "X"]
    assert BATCHED in lower_op(adjoint, "kernel")
    # too few items, or items too large, keep the panels; forced, a product of a few items is batched
    few = neoflow.op(
        "C[b, i, j] = ReduceAdd({k}, A[b, i, k] * B[b, k, j])", shapes={"A": (4, 20, 64), "B": (4, 64, 70)}
    )
    large = neoflow.op(
        "C[b, i, j] = ReduceAdd({k}, A[b, i, k] * B[b, k, j])", shapes={"A": (8, 200, 256), "B": (8, 256, 200)}
    )
    assert BATCHED not in lower_op(few, "kernel") and BATCHED not in lower_op(large, "kernel")
    forced = KernelChoice("blocked", gemm.Blocking(structure="batched"))
    code = lower_op(few, "KERNEL", forced)
    assert BATCHED in code
    for op in (heads, adjoint, few):
        assert_compiled_matches_interpreter(op, 4)
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(t.shape).astype(np.float32) for t in few.inputs]
    expected = neoflow.evaluate(few, {t.name: a for t, a in zip(few.inputs, inputs, strict=True)})
    np.testing.assert_allclose(tuning._Candidate(few, forced, code, inputs)(), expected, rtol=2e-4, atol=2e-4)
