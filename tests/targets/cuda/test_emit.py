"""The CUDA C++ of SIMT kernels: a reduction computed once where it does not change, and read by
name wherever a copy of it is; a split kernel's finishing kernel walking its output in memory order
(checked in the source; ``test_gpu`` runs them)."""

from __future__ import annotations

import dataclasses
import re

import neoflow
from neoflow.ir.expr import Reduce
from neoflow.targets.cuda.emit import (
    canonical_reduction,
    finish_source,
    invariant_reductions,
    memory_order,
    simt_source,
)
from neoflow.targets.cuda.plan import SimtKernel, plan_op, tensor_core_plan
from tests.targets.cuda.gpu_cases import capsule, softmax_parts


def _source(op) -> str:
    (kernel,) = plan_op(op, "k", "fp32").kernels
    assert isinstance(kernel, SimtKernel)
    return simt_source(kernel)


def test_a_softmax_computes_its_row_max_once_a_point() -> None:
    source = _source(softmax_parts())
    assert source.count("NF_FMAX(") == 1  # two copies, one of them inside the sum: one loop
    declared = re.findall(r"const auto (nf_h\d+) = ", source)
    assert len(declared) == 2  # the max, then the sum reading it
    maximum, total = declared
    assert source.index(f"const auto {maximum}") < source.index(f"const auto {total}")
    assert f"- {maximum})" in source.split(f"const auto {total}")[1]


def test_a_reduction_a_select_guards_stays_inside_the_branch() -> None:
    source = _source(softmax_parts())
    body = source.split("nf_out[nf_flat] = ")[1]
    assert "(v_n >= 1) ? ([&]()" in body  # the row before is read only from the second row on
    assert "v_f" not in source.split("nf_out[nf_flat] = ")[0]


def test_an_adjoints_recomputed_reductions_are_computed_once_each() -> None:
    adjoint = neoflow.grad(softmax_parts())["X"]
    source = _source(adjoint)
    assert source.count("NF_FMAX(") == 1
    kinds = [r for r in invariant_reductions(adjoint.body, frozenset()) if r.kind == "ReduceMax"]
    assert len(kinds) >= 2 and len({canonical_reduction(r) for r in kinds}) == 1  # copies, named apart


def test_only_reductions_evaluated_wherever_their_place_is_are_hoisted() -> None:
    op = neoflow.op(
        "Y[n] = ReduceAdd({k}, X[n, k] * ReduceAdd({m}, X[n, m])) + ReduceAdd({j: 3 | j + n < 6}, "
        "ReduceAdd({l}, X[n + j, l])) + ReduceAdd({i}, Select(i >= 1 && ReduceAdd({p}, X[n, p]) > 0, 1, 0) * X[n, i])",
        shapes={"X": (6, 4)},
    )
    bound = frozenset({"k"})
    found = invariant_reductions(op.body, frozenset())
    names = [tuple(r.axes) for r in found]
    assert ("m",) in names  # inside the sum over k, not using k
    assert ("l",) not in names  # inside a guarded sum: its reads are valid only where the guard holds
    assert ("p",) not in names  # on the right of &&: evaluated only where the left holds
    assert all(isinstance(r, Reduce) for r in found)
    inner = next(r for r in found if r.axes == ("k",))
    assert [r.axes for r in invariant_reductions(inner.body, bound)] == [("m",)]


def test_a_finishing_kernels_neighbouring_threads_take_neighbouring_outputs() -> None:
    # a weight gradient's columns (output channel, pose column) come last in the view, but its pose
    # column and its input channel's row lie outermost in memory: the walk follows the strides
    op = neoflow.grad(capsule(2, batch=4, channels=16, out=6))["W"]
    (kernel,) = tensor_core_plan(op, "k", "tf32", use_table=False).kernels
    view = kernel.view
    assert [name for name, _ in view.n] == ["k", "j"] and view.m[0][0] == "c"
    order = [name for name, _ in memory_order(view)]
    assert order == ["k", "c", "r", "s", "t", "j"]
    source = finish_source(dataclasses.replace(kernel, splits=2))
    assert "const int v_j = nf_pp_rest % 4;" in source and "const int v_k = nf_pp_rest;" in source


def test_a_finishing_kernel_keeps_the_views_order_where_the_offset_is_not_affine() -> None:
    from types import SimpleNamespace

    from neoflow.ir import index

    a, b = index.var("a"), index.var("b")
    affine = SimpleNamespace(batch=(), m=(("a", 4),), n=(("b", 3),), out_offset=a + 4 * b)
    assert memory_order(affine) == [("b", 3), ("a", 4)]
    folded = SimpleNamespace(batch=(), m=(("a", 4),), n=(("b", 3),), out_offset=(a // 2) * 6 + b)
    assert memory_order(folded) == [("a", 4), ("b", 3)]
