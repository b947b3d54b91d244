"""Lowering to C loop nests: what the generated loops look like."""

from __future__ import annotations

import re

import neoflow
from neoflow.codegen.lower import Lowering, lower_op


def _c(text: str, shapes: dict, out_shape=None) -> str:
    return lower_op(neoflow.op(text, shapes=shapes, out_shape=out_shape), "kernel")


def test_affine_select_guard_becomes_loop_bounds() -> None:
    code = _c(
        "B[n, c, h, w] = Select(h>2 && h<226 && w>2 && w<226, A[n, c, h-2, w-2], 0)",
        {"A": (1, 3, 224, 224)},
        (1, 3, 228, 228),
    )
    assert "?" not in code  # no per-element select: the two branches are separate statements
    assert "for (int c3 = 3; c3 <= 225; c3 += 1)" in code


def test_strided_adjoint_domain_becomes_a_strided_loop() -> None:
    op = neoflow.op("Y[p] = ReduceAdd({r}, X[2*p + r] * W[r])", shapes={"X": (21,), "W": (5,)})
    code = Lowering(neoflow.grad(op)["X"]).function("kernel")  # the loop nest of the whole lattice
    # dX[z] sums over the r with (z - r) % 2 == 0: isl enumerates only those, two apart
    assert re.search(r"for \(int c\d+ = [^;]*; c\d+ <= [^;]*; c\d+ \+= 2\)", code), code
    assert "nf_mod" not in code  # the lattice condition is not tested per point


def test_reduction_accumulates_in_place_outside_the_innermost_output_loop() -> None:
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (64, 64), "B": (64, 16)})
    code = Lowering(op).function("kernel")  # the loop nest (lower_op would take the blocked kernel here)
    init = code.index("= ((float)(0))")
    update = code.index("out[(v_i) * 16 + v_j] = out[(v_i) * 16 + v_j] + ")
    assert init < update
    loops = code[code.index("void kernel") :]
    # i outermost and parallel, then the reduction loop over k, then j innermost (vectorisable updates)
    assert loops.index("#pragma omp parallel for") < loops.index("for (int c0")
    assert loops.index("for (int c2 = 0; c2 <= 63") < loops.index("for (int c3 = 0; c3 <= 15")
    small = _c("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", {"A": (8, 5), "B": (5, 6)})
    assert "omp parallel" not in small  # too little work to start threads for


def test_reduction_inside_an_expression_uses_an_accumulator() -> None:
    code = _c("Y[i] = log(ReduceAdd({k}, X[i, k] * X[i, k]))", {"X": (512, 64)})
    init = code.index("acc0 = ((float)(0))")
    update = code.index("acc0 = acc0 + ")
    store = code.index("out[")
    assert init < update < store
    assert "#pragma omp parallel for private(acc0)" in code


def test_scatter_is_zeroed_first_and_not_parallel() -> None:
    op = neoflow.op("Out[idx[i]] += X[i]", shapes={"X": (6,), "idx": (6,), "Out": (4,)}, dtypes={"idx": "int64"})
    code = lower_op(op, "kernel")
    assert "memset(out, 0" in code and "+=" in code
    assert "omp parallel" not in code


def test_ops_differing_only_in_names_lower_to_the_same_code() -> None:
    a = _c("Y[i] = X[i] * 2", {"X": (5,)})
    b = _c("Z[i] = W[i] * 2", {"W": (5,)})
    assert a == b
