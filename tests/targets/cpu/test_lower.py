"""Lowering to C loop nests: what the generated loops look like."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

import neoflow
from neoflow.codegen.inner_split import split_inner
from neoflow.codegen.lattice import split_lattice
from neoflow.targets.cpu.estimate import _schedule_once, schedule
from neoflow.targets.cpu.lower import KernelChoice, Lowering, in_place_reduction, lower_op, most_trips, trip_count
from neoflow.targets.cpu.prelude import PARALLEL_MIN_POINTS
from tests.on_targets import NEEDS_CC


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


DEPTHWISE = (
    "Y[n, c, h, w] = ReduceAdd({r, s}, Select(h + r - 1 >= 0 && h + r - 1 < 12 && w + s - 1 >= 0 && w + s - 1 < 12, "
    "X[n, c, h + r - 1, w + s - 1], 0) * W[c, r, s]) + B[c]"
)


def test_a_padding_guard_on_a_sum_becomes_its_loops_bounds() -> None:
    """A padded depthwise convolution (no blocked kernel: one input channel per output channel) is a
    loop nest whose padding test was a select at every point, which kept its innermost loop from
    vectorising (4x slower on MobileNetV2's); the guard is the sum's domain instead.  (Such a
    convolution takes the window path first, ``test_window``; the nest is the tuner's alternative.)"""
    shapes = {"X": (2, 5, 12, 12), "W": (5, 3, 3), "B": (5,)}
    nest = KernelChoice(path="nest")
    code = lower_op(neoflow.op(DEPTHWISE, shapes=shapes, out_shape=(2, 5, 12, 12)), "kernel", nest)
    assert "?" not in _statements(code)
    assert re.search(r"for \(int c\d+ = max\(0, -c\d+ \+ 1\); c\d+ <= min\(11, -c\d+ \+ 12\)", code), code
    op = neoflow.op(DEPTHWISE, shapes=shapes, out_shape=(2, 5, 12, 12))
    inputs = {
        name: np.random.default_rng(1).standard_normal(shape).astype(np.float32) for name, shape in shapes.items()
    }
    np.testing.assert_allclose(
        neoflow.compile(op, target="cpu").run(inputs), neoflow.evaluate(op, inputs), rtol=1e-5, atol=1e-5
    )


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


def test_a_per_channel_sum_runs_along_the_rows_it_reads_not_across_them() -> None:
    """A BatchNorm statistic: accumulated in place, ``c`` innermost, each step would read a float a
    plane apart; summed per channel instead, the innermost loop runs along ``w`` in vector lanes."""
    shapes = {"G": (4, 16, 8, 8), "X": (4, 16, 8, 8), "M": (16,)}
    op = neoflow.op("S[c] = ReduceAdd({n, h, w}, G[n, c, h, w] * (X[n, c, h, w] - M[c]))", shapes=shapes)
    assert in_place_reduction(op) is None
    code = Lowering(op).function("kernel")
    assert "simd reduction(+:acc0)" in code
    assert schedule(op).vector
    row = neoflow.op("S[h, w] = ReduceAdd({n}, X[n, h, w])", shapes={"X": (4, 8, 8)})
    assert in_place_reduction(row) is not None  # reads run along w: in place, w innermost, stays
    # the cost model's vector lanes: a step of the inner loop moves every access by 0 or 1
    assert schedule(neoflow.op("Y[i] = X[i] + X[3]", shapes={"X": (64,)})).vector
    for text in ("Y[i] = X[2*i]", "Y[i] = X[i // 2]", "Y[i] = X[i % 4]"):
        assert not schedule(neoflow.op(text, shapes={"X": (64,)}, out_shape=(32,))).vector, text


def test_a_sum_over_a_planes_rows_and_columns_runs_as_one_vector_loop() -> None:
    """A BatchNorm statistic sums each (n, c) plane: its h and w loops walk one contiguous run, so
    they are one loop over the run, split into vector lanes (rather than a 32-long row at a time)."""
    shapes = {"X": (4, 16, 8, 32), "M": (16,)}
    for text in (
        "S[c] = ReduceAdd({n, h, w}, X[n, c, h, w])",
        "S[c] = ReduceAdd({n, h, w}, (X[n, c, h, w] - M[c]) * 2)",
    ):
        code = Lowering(neoflow.op(text, shapes=shapes)).function("kernel")
        flat = re.search(
            r"#pragma omp simd reduction\(\+:acc0\)\n\s*"
            r"for \(int c4 = 0; c4 <= 255; c4 \+= 1\)\n\s*S1\(c0, c2, 0, c4\);",
            code,
        )
        assert flat, text
        assert code.count("#pragma omp simd") == 1 and "collapse(2)" not in code
    # a variable of the run used elsewhere (here as a value): the two loops split into lanes together
    code = Lowering(neoflow.op("S[c] = ReduceAdd({n, h, w}, X[n, c, h, w] * h)", shapes=shapes)).function("kernel")
    assert re.search(r"#pragma omp simd reduction\(\+:acc0\) collapse\(2\)\n\s*for \(int c3 = 0; c3 <= 7", code)
    # where the two loops do not walk one run, each row stays a loop of its own
    apart = {
        "S[c] = ReduceAdd({n, h, w}, X[n, c, w, h])": {"X": (4, 16, 32, 32)},  # transposed
        "S[c] = ReduceAdd({n, h, w: 16}, X[n, c, h, w])": {"X": (4, 16, 8, 32)},  # half of each row
        "S[c] = ReduceAdd({n, h: 8, w}, X[n, c, h + 1, w])": {"X": (4, 16, 9, 32)},  # an offset row
    }
    for text, shapes in apart.items():
        code = Lowering(neoflow.op(text, shapes=shapes)).function("kernel")
        assert "collapse(2)" not in code.replace("parallel for collapse(2)", ""), text
        assert "S1(c0, c2, c3, c4)" in code, text


@NEEDS_CC
@pytest.mark.parametrize(
    ("text", "shape"),
    [
        ("S[c] = ReduceAdd({n, h, w}, (X[n, c, h, w] - M[c]) * (X[n, c, h, w] - M[c]))", "S1(c0, c2, 0, c4)"),
        # a global average pool under a ReLU6: the clamp's selections in the one loop over each plane
        ("S[n, c] = ReduceAdd({h, w}, min(max(X[n, c, h, w], 0), 6)) / 96", "S1(c0, c1, 0, c4)"),
        ("S[c] = ReduceAdd({n, h, w}, X[n, c, h, w] * (h + w))", "collapse(2)"),
    ],
)
def test_a_run_of_a_sum_computes_what_the_interpreter_does(text: str, shape: str) -> None:
    shapes = {"X": (3, 5, 6, 16), "M": (5,)}
    op = neoflow.op(text, shapes={k: v for k, v in shapes.items() if k in text})
    assert shape in Lowering(op).function("kernel")
    rng = np.random.default_rng(0)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) * 4 for t in op.inputs}
    got = neoflow.compile(op, target="cpu").run(inputs)
    got = got[op.name] if isinstance(got, dict) else got
    want = neoflow.evaluate(op, inputs)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_reductions_inside_an_expression_use_accumulators() -> None:
    code = _c("Y[i] = ReduceAdd({k}, X[i, k]) / ReduceAdd({k}, X[i, k] * X[i, k])", {"X": (512, 64)})
    init = code.index("acc0 = ((float)(0))")
    update = code.index("acc0 = acc0 + ")
    store = code.index("out[")
    assert init < update < store
    assert "#pragma omp parallel for private(acc0, acc1)" in code
    # each sum's loop is split into vector lanes
    assert "#pragma omp simd reduction(+:acc0)" in code and "#pragma omp simd reduction(+:acc1)" in code


def test_one_reduction_under_an_epilogue_accumulates_in_place_then_finishes() -> None:
    code = _c("Y[i, j] = Select(j > 0, ReduceAdd({k}, A[i, k] * B[k, j]), 0) + 1", {"A": (7, 9), "B": (9, 30)})
    assert "acc0" not in code
    update = code.index("out[(v_i) * 30 + v_j] = out[(v_i) * 30 + v_j] + ")
    finish = code.index("out[(v_i) * 30 + v_j] = (((v_j > 0) ? out[(v_i) * 30 + v_j] : ")
    assert update < finish


def test_a_scalar_sum_is_shared_among_threads_and_vector_lanes() -> None:
    code = _c("L[] = ReduceAdd({a, b}, X[a, b] * X[a, b]) / 2", {"X": (300, 200)})
    assert "#pragma omp parallel for reduction(+:acc0)" in code
    assert "#pragma omp simd reduction(+:acc0)" in code


@NEEDS_CC
@pytest.mark.parametrize(
    ("text", "shapes"),
    [
        ("Y[i, j] = Select(j > 0, ReduceAdd({k}, A[i, k] * B[k, j]), 0) + 1", {"A": (7, 9), "B": (9, 30)}),
        ("L[] = ReduceAdd({a, b}, A[a, b] * A[a, b]) / 2", {"A": (300, 200)}),
        ("Y[i] = ReduceAdd({k}, A[i, k]) / ReduceAdd({k}, A[i, k] * A[i, k])", {"A": (512, 64)}),
        ("S[c] = ReduceAdd({n, h, w}, G[n, c, h, w] * G[n, c, h, w])", {"G": (3, 8, 5, 7)}),
    ],
)
def test_epilogues_and_sums_compute_what_the_interpreter_does(text: str, shapes: dict) -> None:
    op = neoflow.op(text, shapes=shapes)
    inputs = {
        name: np.random.default_rng(0).standard_normal(shape).astype(np.float32) for name, shape in shapes.items()
    }
    compiled = neoflow.compile(op, target="cpu").run(inputs)
    expected = neoflow.compile(op, target="interp").run(inputs)
    np.testing.assert_allclose(compiled, expected, rtol=1e-4, atol=1e-4)


def _statements(code: str) -> str:
    """The statements' bodies (the ``#define S<k>`` lines) of lowered code."""
    return "\n".join(line for line in code.splitlines() if line.startswith("#define S"))


def test_a_data_dependent_choice_of_values_is_made_without_a_branch() -> None:
    # a ReLU's mask: taken as a branch, it is mispredicted about every other point
    mask = _c("Y[i, j] = G[i, j] * Select(X[i, j] >= 0, 1, 0)", {"G": (9, 7), "X": (9, 7)})
    assert "nf_pickf(" in mask and " ? " not in _statements(mask)
    # a choice of a read keeps the branch: a guard may keep a read in bounds, and a read not taken costs nothing
    guard = _c("Y[i] = Select(K[i] > 0, X[i], 0)", {"K": (5,), "X": (5,)})
    assert "nf_pickf(" not in guard and " ? " in _statements(guard)


@NEEDS_CC
def test_a_choice_made_without_a_branch_computes_what_the_interpreter_does() -> None:
    op = neoflow.op(
        "Y[i] = G[i] * Select(X[i] >= 0, 1, 0) + Select(X[i] < 1, 0.5, X[i] * 0 + 2)", shapes={"G": (8,), "X": (8,)}
    )
    inputs = {
        "G": np.array([1.0, np.nan, np.inf, -np.inf, 2.0, -3.0, np.nan, 4.0], np.float32),
        "X": np.array([1.0, 2.0, -1.0, 0.0, -0.0, np.nan, -5.0, 3.0], np.float32),
    }
    compiled = neoflow.compile(op, target="cpu").run(inputs)
    expected = neoflow.compile(op, target="interp").run(inputs)
    np.testing.assert_array_equal(compiled, expected)  # NaN * 0 and inf * 0 stay NaN, as multiplying does


def test_scatter_is_zeroed_first_and_not_parallel() -> None:
    op = neoflow.op("Out[idx[i]] += X[i]", shapes={"X": (6,), "idx": (6,), "Out": (4,)}, dtypes={"idx": "int64"})
    code = lower_op(op, "kernel")
    assert "memset(out, 0" in code and "+=" in code
    assert "omp parallel" not in code


def test_ops_differing_only_in_names_lower_to_the_same_code() -> None:
    a = _c("Y[i] = X[i] * 2", {"X": (5,)})
    b = _c("Z[i] = W[i] * 2", {"W": (5,)})
    assert a == b


@NEEDS_CC
def test_a_short_outer_loop_is_collapsed_with_the_loop_it_holds() -> None:
    # three channels would keep at most three threads busy: channel and row are shared out together
    text = "Y[c, h, w] = max(X[c, h, w], 0) * X[c, h, w]"
    shapes = {"X": (3, 200, 200)}
    code = _c(text, shapes)
    assert "#pragma omp parallel for collapse(2)" in code
    assert "collapse" not in _c(text, {"X": (32, 200, 200)})
    op = neoflow.op(text, shapes=shapes)
    rng = np.random.default_rng(3)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}
    expected = neoflow.evaluate(op, inputs)
    np.testing.assert_allclose(neoflow.compile(op, target="cpu").run(inputs), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("loop", "count"),
    [
        ("for (int c1 = 0; c1 <= 2; c1 += 1)", 3),
        ("for (int c1 = 3; c1 <= 18; c1 += 1)", 16),
        ("for (int c1 = max(0, c0 - 3); c1 <= 2; c1 += 1)", float("inf")),
        ("for (int c1 = 0; c1 <= min(5, c0); c1 += 1)", float("inf")),
    ],
)
def testtrip_count_of_constant_loops(loop: str, count: float) -> None:
    assert trip_count(loop) == count


@pytest.mark.parametrize(
    ("loop", "bound"),
    [
        ("for (int c1 = 0; c1 <= 2; c1 += 1)", 3),
        ("for (int c8 = max(0, c3 - 1); c8 <= min(1, c3); c8 += 1)", 2),  # at most two terms
        ("for (int c7 = max(max(0, c1), -3); c7 <= min(4, 2 * c1); c7 += 1)", 8),  # the top-level constants
        ("for (int c1 = 0; c1 < 5; c1 += 1)", 5),
        ("for (int c1 = max(0, c0 - 3); c1 <= c0; c1 += 1)", float("inf")),
        ("for (int c1 = c0; c1 <= min(5, c0 + 9); c1 += 1)", float("inf")),
    ],
)
def test_most_trips_bounds_loops_by_their_constant_ends(loop: str, bound: float) -> None:
    assert most_trips(loop) == bound


def test_a_sum_of_a_few_terms_is_not_split_into_vector_lanes() -> None:
    # a strided conv's input adjoint: each point sums the 1 or 2 taps of its residue class; vector lanes
    # for 2 terms sent the partial sums through the stack at every point
    # (the second stage of the capsule conv's: the 1 to 4 partial products of each pixel summed)
    text = (
        "T[b, z, w] = ReduceAdd({r, s | (z - r) % 2 == 0 && (z - r) // 2 >= 0 && (z - r) // 2 < 2 && "
        "(w - s) % 2 == 0 && (w - s) // 2 >= 0 && (w - s) // 2 < 2}, S[b, (z - r) // 2, (w - s) // 2, r, s])"
    )
    code = _c(text, {"S": (32, 2, 2, 3, 3)}, out_shape=(32, 5, 5))
    assert "c4 <= min(1, c1)" in code, "each residue class sums at most two taps a dimension"
    assert "acc0 = acc0 + " in code and "simd" not in code
    long = _c("Y[i] = ReduceAdd({k}, X[i, k]) / ReduceAdd({k}, X[i, k] * X[i, k])", {"X": (512, 64)})
    assert "#pragma omp simd reduction(+:acc0)" in long


def test_the_pieces_of_a_strided_adjoint_share_out_their_loops_where_the_whole_op_would() -> None:
    # each parity piece of the capsule conv's input gradient is a quarter of the op or less, below the
    # points that start threads; the op as a whole is not (57600 box points): every piece runs in parallel
    text = (
        "T[b, z, w] = ReduceAdd({r, s | (z - r) % 2 == 0 && (z - r) // 2 >= 0 && (z - r) // 2 < 2 && "
        "(w - s) % 2 == 0 && (w - s) // 2 >= 0 && (w - s) // 2 < 2}, S[b, (z - r) // 2, (w - s) // 2, r, s])"
    )
    op = neoflow.op(text, shapes={"S": (256, 2, 2, 3, 3)}, out_shape=(256, 5, 5))
    pieces = split_lattice(op)
    assert len(pieces) == 4 and all(math.prod(p.op.extent.values()) < PARALLEL_MIN_POINTS for p in pieces)
    code = lower_op(op, "kernel")
    functions = [code.split(f"static void kernel_p{k}(")[1].split("\n}\n")[0] for k in range(len(pieces))]
    assert all("#pragma omp parallel for" in function for function in functions)
    # the stores into the output's 6400 points stay on one thread, as a store of all of them would
    assert code.split("void kernel(")[1].count("#pragma omp") == 0


def test_a_sum_over_rows_of_six_terms_is_split_into_vector_lanes() -> None:
    # the capsule conv's weight gradient: each weight sums batch x 6 x 6 terms, the innermost loop 6
    # of them; one scalar accumulator made every term wait for the one before (36 against 19 us).
    # (``lower_op`` now copies it flat first, ``test_flat_depth``; the loop nest is what runs where
    # the copies would not fit.)
    text = "W[k, r, s, j] = ReduceAdd({b, p, q}, G[b, k, p, q, j] * X[b, p + r, q + s])"
    code = Lowering(neoflow.op(text, shapes={"G": (4, 2, 6, 6, 2), "X": (4, 8, 8)})).function("kernel")
    loops = [line.strip() for line in code.splitlines() if "for (" in line or "pragma" in line]
    assert loops[-2:] == ["#pragma omp simd reduction(+:acc0)", "for (int c7 = 0; c7 <= 5; c7 += 1)"]


@NEEDS_CC
def test_a_short_outer_loop_holding_several_statements_is_not_collapsed() -> None:
    # the channels below 2 and the others are separate loops inside the batch loop
    op = neoflow.op("Y[n, c, h] = Select(c < 2, X[n, c, h], 2 * X[n, c, h])", shapes={"X": (2, 4, 9000)})
    code = lower_op(op, "kernel")
    assert "collapse" not in code
    inputs = {"X": np.random.default_rng(4).standard_normal((2, 4, 9000)).astype(np.float32)}
    np.testing.assert_allclose(neoflow.compile(op, target="cpu").run(inputs), neoflow.evaluate(op, inputs))


@NEEDS_CC
def test_a_few_output_rows_sharing_a_read_are_updated_together_innermost() -> None:
    # three output channels read the same row of dY: the channel loop goes inside the row loop
    text = "dX[c, y, x] = ReduceAdd({k, r | y - r >= 0 && y - r < 30}, dY[k, y - r, x] * W[k, c, r])"
    op = neoflow.op(text, shapes={"dY": (8, 30, 40), "W": (8, 3, 3)}, out_shape=(3, 32, 40))
    code = Lowering(op).function("kernel")
    update = next(line for line in code.splitlines() if line.lstrip().startswith("S1("))
    loop = code.splitlines()[code.splitlines().index(update) - 1].strip()
    assert loop.startswith("for (int") and "<= 2;" in loop, "the channel loop should hold the update"
    rng = np.random.default_rng(5)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}
    np.testing.assert_allclose(
        neoflow.compile(op, target="cpu").run(inputs), neoflow.evaluate(op, inputs), rtol=1e-4, atol=1e-4
    )
    # where every read moves with the channel, nothing is shared: the usual order stays
    alone = "Z[c, y, x] = ReduceAdd({k}, V[c, k, y, x] * U[k])"
    plain = Lowering(neoflow.op(alone, shapes={"V": (3, 8, 32, 40), "U": (8,)})).function("kernel")
    update = next(line for line in plain.splitlines() if line.lstrip().startswith("S1("))
    assert "<= 2;" not in plain.splitlines()[plain.splitlines().index(update) - 1]


DEPTH_TO_SPACE = "E[n, c, h, w] = D[n, c*4 + h%2*2 + w%2, h//2, w//2]"


def test_a_depth_to_space_op_alone_runs_over_its_split_inner_index() -> None:
    # w = 2*q + r with r innermost: each of the two steps of r a unit-stride read, no w % 2 per point
    code = _c(DEPTH_TO_SPACE, {"D": (1, 16, 6, 10)}, (1, 4, 12, 20))
    assert "v_w_div2" in code and "v_w_mod2" in code
    assert "nf_mod(v_w," not in code and "nf_fdiv(v_w," not in code
    assert split_inner(neoflow.op("S[] = X[0] * 2", shapes={"X": (4,)}), None) is None  # nothing to split


@NEEDS_CC
@pytest.mark.parametrize(
    ("text", "shapes", "out_shape"),
    [
        (DEPTH_TO_SPACE, {"D": (2, 16, 6, 10)}, (2, 4, 12, 20)),
        # a concat with a depth-to-space branch (the seed's F): the split applies to both branches
        (
            "F[n, c, h, w] = Select(c < 3, A[n, c, h, w], D[n, 4*c + 2*(h%2) + w%2 - 12, h//2, w//2])",
            {"A": (1, 3, 12, 20), "D": (1, 16, 6, 10)},
            (1, 7, 12, 20),
        ),
    ],
)
def test_split_inner_ops_compute_what_the_interpreter_does(text: str, shapes: dict, out_shape: tuple) -> None:
    op = neoflow.op(text, shapes=shapes, out_shape=out_shape)
    assert "v_w_div2" in lower_op(op, "kernel")
    rng = np.random.default_rng(1)
    inputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    compiled = neoflow.compile(op, target="cpu").run(inputs)
    expected = neoflow.compile(op, target="interp").run(inputs)
    np.testing.assert_array_equal(compiled, expected)


def test_a_row_max_runs_in_vector_lanes_and_propagates_nan() -> None:
    """A max (min) over a row is split into vector lanes by a reduction the prelude declares; its lanes
    combine as numpy's max does: a NaN anywhere in the row is the row's max."""
    rowmax = neoflow.op("M[i] = ReduceMax({k}, X[i, k])", shapes={"X": (6, 64)})
    rowmin = neoflow.op("M[i] = ReduceMin({k}, X[i, k])", shapes={"X": (6, 64)})
    assert "simd reduction(nf_fmaxf:" in lower_op(rowmax, "kernel")
    assert "simd reduction(nf_fminf:" in lower_op(rowmin, "kernel")
    x = np.random.default_rng(2).standard_normal((6, 64)).astype(np.float32)
    x[1, 37], x[4, 0], x[5, 63] = np.nan, np.nan, np.nan
    for op, reference in ((rowmax, np.max), (rowmin, np.min)):
        got = neoflow.compile(op, target="cpu").run({"X": x})
        np.testing.assert_array_equal(got, reference(x, axis=1))


def test_ops_alike_but_for_their_tensors_and_variables_names_are_scheduled_once() -> None:
    # a network's repeated layers' adjoints name their variables after their tensors: one schedule serves all
    shapes = {"A": (48, 64), "B": (64, 40)}
    first = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes=shapes)
    second = neoflow.op("D[x, y] = ReduceAdd({z}, P[x, z] * Q[z, y])", shapes={"P": (48, 64), "Q": (64, 40)})
    _schedule_once.cache_clear()
    assert schedule(first) == schedule(second)
    info = _schedule_once.cache_info()
    assert (info.misses, info.hits) == (1, 1)
