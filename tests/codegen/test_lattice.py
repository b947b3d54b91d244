"""Lattice domains split into dense pieces: the pieces, and compiled results equal to the interpreter's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import sympy

import neoflow
from neoflow.codegen.lattice import Piece, piece_target, split_lattice
from neoflow.ir import index
from neoflow.ir.expr import Binary, Index, Read, index_variables
from neoflow.ir.op import Tensor
from neoflow.targets.cpu.gemm import gemm_plan
from neoflow.targets.cpu.lower import lower_op
from tests.on_targets import NEEDS_CC, assert_compiled_matches_interpreter


def _has_mod(op) -> bool:
    return any(isinstance(n, Index) and n.expr.has(sympy.Mod) for n in op.body.walk())


def test_a_strided_adjoint_splits_into_one_dense_piece_per_residue() -> None:
    op = neoflow.op("Y[p] = ReduceAdd({r}, X[2*p + r] * W[r])", shapes={"X": (21,), "W": (5,)})
    pieces = split_lattice(neoflow.grad(op)["X"])
    assert [(p.base, list(p.strides.values()), p.op.shape, p.empty) for p in pieces] == [
        (0, [2], (11,), False),  # even z: r in {0, 2, 4}
        (1, [2], (10,), False),  # odd z: r in {1, 3}
    ]
    assert not any(_has_mod(p.op) for p in pieces)
    assert sorted(dict(p.op.ranges)[p.op.reduce_axes[0]] for p in pieces) == [2, 3]


def test_a_condition_on_the_output_alone_leaves_zero_pieces() -> None:
    # the four-op graph's dilated conv: dB is non-zero only at even rows and columns
    op = neoflow.op(
        "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
        shapes={"B": (1, 3, 20, 20), "C": (8, 3, 3, 3)},
    )
    pieces = split_lattice(neoflow.grad(op)["B"])
    assert [p.empty for p in pieces].count(False) == 1
    assert sum(p.op.output.size for p in pieces) == 1 * 3 * 20 * 20  # the pieces tile the output


def test_a_lattice_over_two_reduction_axes_is_not_split() -> None:
    op = neoflow.op("Y[i] = ReduceAdd({r, s | (r + s) % 2 == 0}, X[i, r] * W[s])", shapes={"X": (4, 6), "W": (6,)})
    assert split_lattice(op) is None
    assert "_p0(" not in lower_op(op, "kernel")  # the plain loop nest of the whole domain


CASES = {
    "stride_2_1d": ("Y[p] = ReduceAdd({r}, X[2*p + r] * W[r])", {"X": (21,), "W": (5,)}, "X"),
    "stride_3_conv": (
        "Y[n, k, p] = ReduceAdd({c, r}, X[n, c, 3*p + r] * W[k, c, r])",
        {"X": (2, 4, 23), "W": (5, 4, 4)},
        "X",
    ),
    "dilated_stride_2": (
        "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
        {"B": (1, 3, 20, 20), "C": (8, 3, 3, 3)},
        "B",
    ),
    "capsule_stride_2": (
        "Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In0[b, c, p*2 + r, q*2 + s, i, t] * In1[k, c, r, s, t, j])",
        {"In0": (2, 3, 9, 9, 4, 4), "In1": (5, 3, 3, 3, 4, 4)},
        "In0",
    ),
}


@NEEDS_CC
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_pieces_equal_the_interpreter(case: str) -> None:
    text, shapes, wrt = CASES[case]
    adjoint = neoflow.grad(neoflow.op(text, shapes=shapes))[wrt]
    assert len(split_lattice(adjoint)) > 1
    assert_compiled_matches_interpreter(adjoint, 0)


def _with_epilogue(op):
    """``op`` minus a read of a new input ``A`` of its shape: an epilogue that is not
    zero where the sum is empty (the four-op step's parameter update fused into dB)."""
    shift = Read("A", tuple(index.var(v) for v in op.indices))
    return replace(op, body=Binary("-", op.body, shift), inputs=(*op.inputs, Tensor("A", op.shape)))


def test_an_epilogue_not_zero_on_an_empty_sum_makes_element_wise_pieces() -> None:
    text, shapes, wrt = CASES["dilated_stride_2"]
    op = _with_epilogue(neoflow.grad(neoflow.op(text, shapes=shapes))[wrt])
    pieces = split_lattice(op)
    assert pieces is not None and not any(p.empty for p in pieces)
    summed = [p for p in pieces if p.op.reductions]
    assert len(summed) == 1 and len(pieces) > 1  # the even rows and columns sum; the rest is -A
    assert sum(p.op.output.size for p in pieces) == op.output.size
    assert "_p1(" in lower_op(op, "kernel")  # computed piece by piece


@NEEDS_CC
def test_element_wise_pieces_compute_what_the_interpreter_does() -> None:
    text, shapes, wrt = CASES["dilated_stride_2"]
    assert_compiled_matches_interpreter(_with_epilogue(neoflow.grad(neoflow.op(text, shapes=shapes))[wrt]), 2)


def test_element_wise_pieces_store_each_point_where_it_goes_and_summed_ones_go_through_a_buffer() -> None:
    text, shapes, wrt = CASES["dilated_stride_2"]
    op = _with_epilogue(neoflow.grad(neoflow.op(text, shapes=shapes))[wrt])
    pieces = split_lattice(op)
    n, c, h, w, z4 = (index.var(v) for v in ("n", "c", "z3_", "z4_", "z4"))
    assert [piece_target(p, op.shape) for p in pieces] == [
        (n, c, 2 * h, 2 * w),  # the even rows and columns: the sum
        (n, c, 2 * h, 2 * w + 1),  # the odd columns of the even rows
        (n, c, 2 * h + 1, z4),  # the odd rows
    ]
    source = lower_op(op, "kernel")
    assert "kernel_p0(part" in source  # summed densely, then scattered
    assert "kernel_p1(out" in source and "kernel_p2(out" in source  # no buffer, no second pass


def test_a_piece_whose_stride_fits_no_dimension_has_no_target() -> None:
    op = neoflow.op("Y[i] = X[i]", shapes={"X": (2,)})
    assert piece_target(Piece(op, {"i": 4}, 1), (4, 6)) == (0, 4 * index.var("i") + 1)
    assert piece_target(Piece(op, {"i": 8}, 0), (4, 6)) is None  # 8 is no multiple of a row, longer than one
    assert piece_target(Piece(op, {"i": 4}, 3), (4, 6)) is None  # its second point runs past the row


# the capsule network's first layer with its input broadcast inlined: ``c`` and ``t`` (extent one)
# index only the weights, so no intrinsic axis could take them while they stayed reduction axes
UNIT_AXES = (
    "C1[b, k, p, q, j] = ReduceAdd({c, r, s, t}, X[b, 0, p + r, q + s] * K[k, c, r, s, t, j])",
    {"X": (16, 1, 8, 8), "K": (4, 1, 3, 3, 1, 2)},
)


def test_reduction_axes_of_extent_one_leave_the_piece_and_the_op_takes_the_blocked_kernel() -> None:
    op = neoflow.op(UNIT_AXES[0], shapes=UNIT_AXES[1])
    (piece,) = split_lattice(op)
    assert piece.op.reduce_axes == ("r", "s")
    assert gemm_plan(op) is not None


@NEEDS_CC
def test_a_piece_without_its_unit_axes_computes_what_the_interpreter_does() -> None:
    assert_compiled_matches_interpreter(neoflow.op(UNIT_AXES[0], shapes=UNIT_AXES[1]), 3)


@NEEDS_CC
@pytest.mark.parametrize("condition", ["u + r < 3", "u + r > 9"])
def test_a_unit_axis_in_the_condition_is_replaced_there_too(condition: str) -> None:
    # u (extent one) is 0 in the condition as in the term; "> 9" leaves no point: the sum is zero
    op = neoflow.op(f"Y[i] = ReduceAdd({{r, u | {condition}}}, X[i, r] * W[u, r])", shapes={"X": (64, 5), "W": (1, 5)})
    (piece,) = split_lattice(op)
    assert piece.op.reduce_axes == ("r",) and "u" not in index_variables(piece.op.body)
    assert_compiled_matches_interpreter(op, 1)


def test_a_stride_with_too_many_residues_is_not_split_and_costs_no_time() -> None:
    """An adjoint of stride 10007 took over a minute to split into 10007 pieces (one substitution
    each) before MAX_PIECES turned it down; now the modulus alone decides, at once."""
    import time

    import numpy as np

    op = neoflow.op("Y[i] = ReduceAdd({r}, X[10007*i + r] * W[r])", shapes={"X": (10007 * 5 + 7,), "W": (7,)})
    adjoint = neoflow.grad(op)["X"]
    start = time.perf_counter()
    assert split_lattice(adjoint) is None
    assert time.perf_counter() - start < 2.0
    compiled = neoflow.compile(op, target="interp", grad=True)
    x, w = np.ones(10007 * 5 + 7, np.float32), np.arange(7, dtype=np.float32)
    dx = compiled.backward({"X": x, "W": w}, {"dY": np.ones(op.shape, np.float32)})["X"]
    assert dx[10007 * 2 + 3] == 3.0 and dx[10007 * 2 + 7] == 0.0  # offset 3 of row 2; past its reach
