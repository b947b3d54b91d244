"""AMOS-style mapping of contractions onto the CPU outer product, the tensor-core MMA and the NPU cube."""

from __future__ import annotations

import pytest

import neoflow
from neoflow.codegen.hardware import AVX2, NPU_CUBE, TENSOR_CORE
from neoflow.codegen.mapping import check_mapping, contraction, mappings

CONV = neoflow.op(
    "Y[n, k, p, q] = ReduceAdd({c, r, s}, X[n, c, p + r, q + s] * W[k, c, r, s])",
    shapes={"X": (2, 16, 10, 10), "W": (32, 16, 3, 3)},
)
CAPSULE = neoflow.op(
    "Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In0[b, c, p*2 + r, q*2 + s, i, t] * In1[k, c, r, s, t, j])",
    shapes={"In0": (2, 4, 9, 9, 4, 4), "In1": (4, 4, 3, 3, 4, 4)},
)
BMM = neoflow.op("C[g, i, j] = ReduceAdd({k}, A[g, i, k] * B[g, k, j])", shapes={"A": (3, 32, 16), "B": (3, 16, 24)})
GEMM = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (64, 32), "B": (32, 48)})

TARGETS = [(AVX2, "outer_product"), (TENSOR_CORE, "mma_16x16x16"), (NPU_CUBE, "cube_16x16x16")]
# (op, a valid mapping, an invalid one and the variable that breaks it)
CASES = {
    "conv2d": (
        CONV,
        ({"a": "X", "b": "W"}, {"i": ("n", "p", "q"), "j": ("k",), "k": ("c", "r", "s")}),
        ({"a": "X", "b": "W"}, {"i": ("k",), "j": ("q",), "k": ("c",)}),
        "'k' indexes (out, right)",
    ),
    "capsule": (
        CAPSULE,
        ({"a": "In0", "b": "In1"}, {"i": ("p", "q", "i"), "j": ("k", "j"), "k": ("c", "r", "s", "t")}),
        ({"a": "In0", "b": "In1"}, {"i": ("p",), "j": ("j",), "k": ("b",)}),
        "'b' indexes (left, out)",
    ),
    "bmm": (
        BMM,
        ({"a": "A", "b": "B"}, {"i": ("i",), "j": ("j",), "k": ("k",)}),
        ({"a": "A", "b": "B"}, {"i": ("g", "i"), "j": ("j",), "k": ("k",)}),
        "'g' indexes (left, out, right)",
    ),
    "gemm": (
        GEMM,
        ({"a": "B", "b": "A"}, {"i": ("j",), "j": ("i",), "k": ("k",)}),
        ({"a": "A", "b": "B"}, {"i": ("i",), "j": ("k",), "k": ("j",)}),
        "'k' indexes (left, right)",
    ),
}


def _groups(mapping) -> dict[str, set[str]]:
    return {axis: set(vs) for axis, vs in mapping.axes}


@pytest.mark.parametrize(("hardware", "intrinsic"), TARGETS, ids=[t.name for t, _ in TARGETS])
@pytest.mark.parametrize("case", list(CASES))
def test_known_valid_mapping_is_found_and_invalid_one_rejected(hardware, intrinsic, case) -> None:
    op, (operands, axes), (bad_operands, bad_axes), reason = CASES[case]
    item = hardware.intrinsic(intrinsic)
    assert check_mapping(op, item, operands, axes) is None
    found = mappings(op, hardware, intrinsic)
    assert found, f"no mapping of {case} onto {intrinsic}"
    wanted = {axis: set(vs) for axis, vs in axes.items()}
    assert any(_groups(m) == wanted and dict(m.operands)["a"] == operands["a"] for m in found), (
        f"{case}: {axes} not among {[m.describe() for m in found[:5]]}"
    )
    message = check_mapping(op, item, bad_operands, bad_axes)
    assert message is not None and reason in message
    # every listed mapping passes the access-matrix check, and scores are sorted
    for m in found:
        assert check_mapping(op, item, dict(m.operands), dict(m.axes)) is None
    assert [m.cycles for m in found] == sorted(m.cycles for m in found)


def test_batch_variables_stay_outer_and_non_contractions_have_no_mapping() -> None:
    for m in mappings(BMM, AVX2, "outer_product"):
        assert "g" in m.outer
    assert contraction(neoflow.op("Y[i] = X[i] * 2", shapes={"X": (4,)})) is None
    assert mappings(neoflow.op("Y[i] = ReduceMax({k}, X[i, k])", shapes={"X": (4, 3)})) == []


def test_padding_utilisation_and_best_mapping() -> None:
    odd = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (20, 20), "B": (20, 20)})
    best = mappings(odd, TENSOR_CORE)[0]
    assert best.utilization == pytest.approx((20 / 32) ** 3)
    gemm = mappings(GEMM, AVX2)
    assert gemm[0].intrinsic == "outer_product"  # register blocking beats a lone FMA or dot product
    assert {m.intrinsic for m in gemm} == {"outer_product", "fma", "dot"}
    assert all(m.bound == "load" for m in gemm if m.intrinsic in ("fma", "dot"))
