"""Contractions in two stages: where the split is made, and compiled results equal to the interpreter's."""

from __future__ import annotations

import neoflow
from neoflow.ir.expr import Read, Reduce
from neoflow.targets.cpu.lower import lower_op
from neoflow.targets.cpu.staging import split_contraction, staged_plan
from tests.on_targets import NEEDS_CC, assert_compiled_matches_interpreter

# the four-op graph's dilated stride-2 convolution, smaller: its input adjoint sums over k, r, s
DILATED = (
    "D[n, k, p, q] = ReduceAdd({r, s}, B[n, c, p*2+r*2, q*2+s*2] * C[k, c, r, s])",
    {"B": (1, 3, 68, 68), "C": (32, 3, 3, 3)},
)


def _dilated_adjoint():
    text, shapes = DILATED
    return neoflow.grad(neoflow.op(text, shapes=shapes))["B"]


def test_the_split_sums_the_plain_axis_first_and_keeps_the_domain_for_the_rest() -> None:
    adjoint = _dilated_adjoint()
    stage, rest = split_contraction(adjoint)
    # the stage: a product of the two operands read in place, over k alone
    assert stage.reduce_axes == ("k",)
    reads = [n for n in stage.body.walk() if isinstance(n, Read)]
    assert all(len(e.free_symbols) == 1 for read in reads for e in read.indices)
    # its partial sums: (c, r, s) of C, then (n, a, b) of grad_D (the operand moving with the output's last index)
    assert stage.shape == (3, 3, 3, 1, 32, 32)
    # the rest: the original domain condition over (r, s), one read of the partial sums
    (reduce,) = [n for n in rest.body.walk() if isinstance(n, Reduce)]
    assert reduce.axes == ("r", "s")
    assert reduce.where == adjoint.reductions[0].where
    assert [t.name for t in rest.inputs] == [stage.name]


def test_the_split_is_taken_where_it_saves_the_im2col_copy() -> None:
    adjoint = _dilated_adjoint()
    assert staged_plan(adjoint) is not None
    assert "_s(sums" in lower_op(adjoint, "kernel")


def test_no_split_where_the_partial_sums_would_outgrow_the_data() -> None:
    # a 3x3 convolution's input adjoint: T would hold (c, r, s) x (n, a, b), nine times dX
    conv = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, p + r, q + s] * W[k, c, r, s])",
        shapes={"X": (2, 16, 14, 14), "W": (16, 16, 3, 3)},
    )
    adjoint = neoflow.grad(conv)["X"]
    assert split_contraction(adjoint) is not None
    assert staged_plan(adjoint) is None


def test_a_plain_matrix_product_is_not_split() -> None:
    gemm = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (64, 64), "B": (64, 64)})
    assert split_contraction(gemm) is None


@NEEDS_CC
def test_the_compiled_stages_equal_the_interpreter() -> None:
    adjoint = _dilated_adjoint()
    assert_compiled_matches_interpreter(adjoint, 0)
