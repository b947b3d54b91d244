"""Random affine index maps: the gather adjoint equals a brute-force scatter adjoint."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import neoflow
from neoflow.autodiff import grad


@st.composite
def affine_reads(draw):
    n_out = draw(st.integers(1, 2))
    n_red = draw(st.integers(0, 2))
    out_vars = ["i", "j"][:n_out]
    red_vars = ["r", "s"][:n_red]
    extents = {v: draw(st.integers(1, 4)) for v in out_vars + red_vars}
    dims = []
    for _ in range(draw(st.integers(1, 3))):
        coeffs = {v: draw(st.integers(-2, 3)) for v in out_vars + red_vars}
        low = sum(min(0, c * (extents[v] - 1)) for v, c in coeffs.items())
        high = sum(max(0, c * (extents[v] - 1)) for v, c in coeffs.items())
        offset = -low + draw(st.integers(0, 1))
        terms = " + ".join(f"({c})*{v}" for v, c in coeffs.items() if c) or "0"
        bare = offset == 0 and sorted(coeffs.values()) == [0] * (len(coeffs) - 1) + [1]
        slack = 0 if bare else draw(st.integers(0, 1))  # a bare variable must match its extent
        dims.append((f"{terms} + {offset}", high - low + offset + 1 + slack))
    return out_vars, red_vars, extents, dims


@settings(max_examples=60, deadline=None)
@given(affine_reads(), st.integers(0, 2**16))
def test_gather_adjoint_matches_brute_force_scatter(read, seed) -> None:
    out_vars, red_vars, extents, dims = read
    index = ", ".join(expr for expr, _ in dims)
    reduce_axes = ", ".join(f"{v}: {extents[v]}" for v in red_vars)
    body = f"X[{index}] * W[{', '.join(out_vars + red_vars)}]"
    text = f"Y[{', '.join(out_vars)}] = " + (f"ReduceAdd({{{reduce_axes}}}, {body})" if red_vars else body)
    shapes = {
        "X": tuple(size for _, size in dims),
        "W": tuple(extents[v] for v in out_vars + red_vars),
        "Y": tuple(extents[v] for v in out_vars),
    }
    op = neoflow.op(text, shapes=shapes, dtype="float64")
    adjoint = grad(op, "X")["X"]
    assert adjoint.info.kind == "gather" and adjoint.info.waste == 0.0, str(adjoint)
    rng = np.random.default_rng(seed)
    w, dy = rng.standard_normal(shapes["W"]), rng.standard_normal(shapes["Y"])
    gathered = neoflow.evaluate(adjoint, {"dY": dy, "W": w})
    scatter = neoflow.op(
        f"dX[{index}] += dY[{', '.join(out_vars)}] * W[{', '.join(out_vars + red_vars)}]",
        shapes={**shapes, "dY": shapes["Y"], "dX": shapes["X"]},
        dtype="float64",
    )
    for v in red_vars:  # reduction axes of the scatter must have their forward extents
        assert scatter.extent[v] == extents[v]
    np.testing.assert_allclose(gathered, neoflow.evaluate(scatter, {"dY": dy, "W": w}), rtol=1e-12, atol=1e-12)
