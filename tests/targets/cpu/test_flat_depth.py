"""Contractions over a depth of short runs, copied flat: where the form is taken, its
copies and product, and compiled results equal to the interpreter's."""

from __future__ import annotations

import neoflow
from neoflow.ir.expr import Read, Reduce
from neoflow.targets.cpu.flat_depth import flat_depth_plan, flat_form
from neoflow.targets.cpu.lower import Lowering, lower_op
from tests.on_targets import NEEDS_CC, assert_compiled_matches_interpreter

CONV = "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, p + r, q + s] * W[k, c, r, s])"


def _weight_gradient(batch: int = 4, channels: int = 4):
    """A small convolution's weight gradient: 36 outputs, a depth of ``batch`` x 6 x 6 in runs of 6."""
    conv = neoflow.op(CONV, shapes={"X": (batch, 1, 8, 8), "W": (channels, 1, 3, 3)})
    return neoflow.grad(conv)["W"]


def test_a_weight_gradient_is_copied_flat_along_its_depth() -> None:
    gradient = _weight_gradient()
    plan = flat_depth_plan(gradient)
    assert plan is not None and (plan.depth, plan.run) == (144, 6)
    pack_a, pack_b = plan.packs
    # each copy: the output indices its read uses, then the depth (n, p, q), the depth last
    assert pack_a.indices[-3:] == pack_b.indices[-3:] == gradient.reduce_axes
    assert pack_a.shape == (4, 4, 6, 6)  # grad_Y's k, then n, p, q
    assert pack_b.shape == (1, 3, 3, 4, 6, 6)  # X's c, r, s, then n, p, q
    # the product: one sum over the flat depth, reading each copy as [side..., depth]
    (reduce,) = plan.product.reductions
    assert reduce.extents == (4 * 6 * 6,)
    assert {t.name: t.shape for t in plan.product.inputs} == {pack_a.name: (4, 144), pack_b.name: (1, 3, 3, 144)}
    depth = reduce.axes[0]
    reads = [node for node in reduce.walk() if isinstance(node, Read)]
    assert [str(read.indices[-1]) for read in reads] == [depth, depth]


def test_the_form_is_not_taken_where_the_depth_runs_long_or_is_short() -> None:
    # a matrix product: its depth is one run of 64 (the loop nest and the blocked kernel read it as is)
    gemm = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (16, 64), "B": (64, 16)})
    assert flat_form(gemm) is not None and flat_depth_plan(gemm) is None
    # the convolution itself: its depth (c, r, s) is 9 terms, too few vectors for a dot product
    conv = neoflow.op(CONV, shapes={"X": (4, 1, 8, 8), "W": (4, 1, 3, 3)})
    assert flat_depth_plan(conv) is None


def test_a_sum_with_a_domain_condition_has_no_flat_form() -> None:
    strided = neoflow.op(
        "Y[n, k, p] = ReduceAdd({c, r}, X[n, c, 2*p + r] * W[k, c, r])", shapes={"X": (2, 3, 33), "W": (4, 3, 3)}
    )
    adjoint = neoflow.grad(strided)["X"]  # a parity condition on its sum
    assert any(node.where is not None for node in adjoint.body.walk() if isinstance(node, Reduce))
    assert flat_form(adjoint) is None


def test_the_product_sums_each_point_in_its_own_innermost_loop() -> None:
    # the output's last dimension (k: 8) is long enough that a sum would accumulate in place,
    # its depth loop outside k; the product keeps each point's dot product innermost instead
    transposed = neoflow.op(
        "G[r, s, k] = ReduceAdd({n, p, q}, D[n, k, p, q] * X[n, p + r, q + s])",
        shapes={"D": (4, 8, 6, 6), "X": (4, 8, 8)},
    )
    plan = flat_depth_plan(transposed)
    assert plan is not None
    # in place, k innermost, would read the packed operand a depth apart each step: not even by default
    assert "simd reduction" in Lowering(plan.product).function("product")
    assert "simd reduction" in Lowering(plan.product, in_place=False).function("product")
    source = lower_op(transposed, "kernel")
    assert "kernel_p(out, pack_a, pack_b);" in source
    assert "simd reduction" in source[source.index("kernel_p(") :]


@NEEDS_CC
def test_the_compiled_flat_form_equals_the_interpreter() -> None:
    for seed, gradient in enumerate((_weight_gradient(), _weight_gradient(batch=3, channels=5))):
        assert flat_depth_plan(gradient) is not None
        assert_compiled_matches_interpreter(gradient, seed)
    transposed = neoflow.op(
        "G[r, s, k] = ReduceAdd({n, p, q}, D[n, k, p, q] * X[n, p + r, q + s])",
        shapes={"D": (3, 8, 6, 6), "X": (3, 8, 8)},
    )
    assert flat_depth_plan(transposed) is not None
    assert_compiled_matches_interpreter(transposed, 2)


@NEEDS_CC
def test_an_epilogue_is_applied_to_each_dot_product() -> None:
    scaled = neoflow.op(
        "G[k, r, s] = 0.5 * ReduceAdd({n, p, q}, D[n, k, p, q] * X[n, p + r, q + s])",
        shapes={"D": (4, 4, 6, 6), "X": (4, 8, 8)},
    )
    assert flat_depth_plan(scaled) is not None
    assert_compiled_matches_interpreter(scaled, 3)
