"""Contractions in two stages: where the split is made, and compiled results equal to the interpreter's."""

from __future__ import annotations

import neoflow
from neoflow.ir.expr import Read, Reduce
from neoflow.targets.cpu import staging
from neoflow.targets.cpu.lower import lower_op
from neoflow.targets.cpu.staging import sliced, split_contraction, staged_plan
from tests.on_targets import HAS_CC, NEEDS_CC, assert_compiled_matches_interpreter

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


# a stride-1 capsule convolution's input adjoint, small: its partial sums are nine times the data it moves
CAPSULE_ADJOINT = (
    "dIn[b, c, y, x, i, t] = ReduceAdd({k, j, r, s | y - r >= 0 && y - r < 4 && x - s >= 0 && x - s < 4}, "
    "dOut[b, k, y - r, x - s, i, j] * W[k, c, r, s, t, j])",
    {"dOut": (4, 8, 4, 4, 2, 2), "W": (8, 8, 3, 3, 2, 2), "dIn": (4, 8, 6, 6, 2, 2)},
)


def _capsule_adjoint():
    text, shapes = CAPSULE_ADJOINT
    return neoflow.op(text, shapes=shapes)


def test_partial_sums_too_large_for_once_are_made_a_batch_slice_at_a_time(monkeypatch) -> None:
    adjoint = _capsule_adjoint()
    stage, _ = split_contraction(adjoint)
    assert stage.output.size > adjoint.output.size + sum(t.size for t in adjoint.inputs)
    monkeypatch.setattr(staging, "GAIN", 10.0)  # taken whatever the estimate
    row_bytes = stage.output.size // adjoint.shape[0] * 4  # float32 partial sums of one row of b
    monkeypatch.setattr(staging, "SLICE_BYTES", 2 * row_bytes)  # two rows of b a slice
    staging.staged_plan.cache_clear()
    try:
        plan = staged_plan(adjoint)
        assert plan is not None and plan.batch == 2
        assert plan.stage.output.shape == (2, *stage.output.shape[1:])  # T holds one slice
        assert plan.rest.shape == (2, *adjoint.shape[1:])
        assert {t.name: t.shape[0] for t in plan.stage.inputs} == {"dOut": 2, "W": 8}  # the weights whole
        source = lower_op(adjoint, "kernel")
        assert "for (int64_t b0 = 0; b0 < 4; b0 += 2)" in source
        assert f"in0 + b0 * {8 * 4 * 4 * 2 * 2}" in source and f"out + b0 * {8 * 6 * 6 * 2 * 2}" in source
        if HAS_CC:  # without a C compiler, the source alone is checked
            assert_compiled_matches_interpreter(adjoint, 1)
    finally:
        staging.staged_plan.cache_clear()


def test_no_slice_where_the_leading_variable_indexes_a_tensor_otherwise() -> None:
    # the leading variable inside another index of a read (a window along it): no slice computes it alone
    window = neoflow.op("Y[p, k] = ReduceAdd({r, c}, X[p + r, c] * W[k, c, r])", shapes={"X": (10, 4), "W": (3, 4, 3)})
    assert sliced(window, 2) is None
    adjoint = _capsule_adjoint()
    _, rest = split_contraction(adjoint)
    cut = sliced(rest, 1)
    assert cut is not None and cut.shape == (1, *adjoint.shape[1:]) and cut.inputs[0].shape[0] == 1
