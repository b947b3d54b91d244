"""Several ops in one loop nest (multi-output kernels): which ops make one, and the C computing them."""

from __future__ import annotations

import numpy as np

import neoflow
from neoflow.targets.base import InterpreterExecutor
from neoflow.targets.cpu.executor import CpuExecutor
from neoflow.targets.cpu.nest import nest_function, shared_nest
from tests.on_targets import NEEDS_CC

# a forward output, the loss summed over it and the loss's gradient: the seed's tail, small
TAIL = """
A = tensor([2, 3, 8, 10])
D = tensor([2, 12, 4, 5])
target = tensor([2, 6, 8, 10])
F[n, c, h, w] = Select(c < 3, A[n, c, h, w], D[n, 4*c + 2*(h%2) + w%2 - 12, h//2, w//2])
loss[] = ReduceAdd({i, j, k, l}, (F[i, j, k, l] - target[i, j, k, l]) * (F[i, j, k, l] - target[i, j, k, l])) / 960
G[i, j, k, l] = 2 * (F[i, j, k, l] - target[i, j, k, l]) / 960
"""


# and the gradient of the depth-to-space input D, as autodiff writes it: G read through the inverse map
GRAD_D = (
    "DG[n, z, p, q] = ReduceAdd({hm: 2, wm: 2 | (z - 2*hm - wm)%4 == 0}, "
    "G[n, (z - 2*hm - wm)//4 + 3, 2*p + hm, 2*q + wm])\n"
)


def _ops(text: str) -> list:
    return list(neoflow.graph(text).ops)


def test_element_wise_ops_and_sums_over_one_domain_make_one_nest() -> None:
    nest = shared_nest(_ops(TAIL))
    assert nest is not None
    assert [t.name for t in nest.outputs] == ["F", "loss", "G"]
    assert [t.name for t in nest.inputs] == ["A", "D", "target"]  # each read once for all three
    assert set(nest.sums) == {"loss"}
    # every member runs over F's indices
    assert all(member.indices == ("n", "c", "h", "w") for member in nest.members)
    source = nest_function(nest, "tail")
    assert "reduction(+:sum1)" in source and "out1[0] = " in source


def test_ops_that_are_not_one_nest_are_refused() -> None:
    ops = _ops(TAIL)
    assert shared_nest(ops[:1]) is None  # one op
    assert shared_nest([ops[2], ops[0]]) is None  # G reads F before F is computed
    shifted = _ops(TAIL.replace("2 * (F[i, j, k, l]", "2 * (F[i, j, k, (l + 1) % 10]"))
    assert shared_nest(shifted) is None  # G reads F at another point than its own
    other_shape = _ops(
        """
X = tensor([4, 8])
Y[i, j] = X[i, j] * 2
S[i] = ReduceAdd({j}, X[i, j])
"""
    )
    assert shared_nest(other_shape) is None  # a sum over part of the domain is not a member
    contraction = _ops(
        """
X = tensor([4, 8])
W = tensor([8, 8])
Y[i, j] = X[i, j] * 2
Z[i, j] = ReduceAdd({k}, X[i, k] * W[k, j])
"""
    )
    assert shared_nest(contraction) is None  # a reduction inside a member's body


@NEEDS_CC
def test_a_nest_computes_what_its_ops_compute_one_by_one() -> None:
    graph = neoflow.graph(TAIL)
    rng = np.random.default_rng(3)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs}
    keep = ("F", "loss", "G")
    expected = InterpreterExecutor(graph, keep).run(inputs)
    executor = CpuExecutor(graph, keep, groups=[("F", "loss", "G")])
    assert list(executor.nests) == ["F"]
    assert executor.source.count("nf_nest0(") == 2  # defined once, called once from nf_run_graph
    got = executor.run(inputs)
    for name in keep:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)
    # timed alone, the nest is one call giving all three
    values = executor.kernel_call(["F", "loss", "G"], inputs)()
    for name in keep:
        np.testing.assert_allclose(values[name], expected[name], rtol=1e-5, atol=1e-6)


@NEEDS_CC
def test_a_nest_does_not_write_over_what_it_still_reads() -> None:
    # D dies at F (its last reader); planned op by op, G could be given D's memory —
    # but the nest writes G while it still reads D
    text = """
X = tensor([64, 64])
target = tensor([64, 64])
D[i, j] = X[i, j] * 3
F[i, j] = D[i, j] + 1
G[i, j] = F[i, j] - target[i, j]
H[i, j] = G[i, j] * G[i, j]
"""
    graph = neoflow.graph(text)
    rng = np.random.default_rng(4)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs}
    expected = InterpreterExecutor(graph, ("H", "F")).run(inputs)
    executor = CpuExecutor(graph, ("H", "F"), groups=[("D",), ("F", "G"), ("H",)])
    assert list(executor.nests) == ["F"]
    assert executor.plan.offsets["G"] != executor.plan.offsets["D"]
    got = executor.run(inputs)
    np.testing.assert_allclose(got["H"], expected["H"], rtol=1e-5)
    np.testing.assert_allclose(got["F"], expected["F"], rtol=1e-5)


def test_a_member_read_through_a_bijective_map_is_written_through_its_inverse() -> None:
    nest = shared_nest(_ops(TAIL + GRAD_D))
    assert nest is not None
    assert [t.name for t in nest.outputs] == ["F", "loss", "G", "DG"]
    assert [t.name for t in nest.inputs] == ["A", "D", "target"]  # G is not read back
    # DG is computed at F's points with c >= 3 and stored at the depth-to-space position
    written = nest.writes["DG"]
    assert str(written.target) == "(n, 4*c + 2*(Mod(h, 2)) + Mod(w, 2) - 12, floor(h/2), floor(w/2))"
    source = nest_function(nest, "tail")
    # F's read of D and DG's write split the innermost index by 2: unit-stride, no per-point w % 2
    assert "v_w_div2" in source and "nf_mod(v_w," not in source


def test_maps_that_are_not_one_to_one_are_refused() -> None:
    pooled = "P[n, c, p, q] = ReduceAdd({a: 2, b: 2}, G[n, c, 2*p + a, 2*q + b])\n"  # four terms a point
    assert shared_nest(_ops(TAIL + pooled)) is None
    twice = "T[n, c, h, w] = G[n, c, 2*h, w] + G[n, c, 2*h + 1, w]\n"  # G read at two points
    assert shared_nest(_ops(TAIL + twice)) is None
    overlapping = "Q = tensor([2, 6, 8, 10])\nQ[n, c, h, w] = ReduceAdd({a: 2 | h + a < 8}, G[n, c, h + a, w])\n"
    assert shared_nest(_ops(TAIL + overlapping)) is None  # a point of G read by two points of Q


@NEEDS_CC
def test_a_nest_writing_through_a_map_computes_what_its_ops_compute() -> None:
    graph = neoflow.graph(TAIL + GRAD_D)
    rng = np.random.default_rng(4)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs}
    keep = ("F", "loss", "G", "DG")
    expected = InterpreterExecutor(graph, keep).run(inputs)
    executor = CpuExecutor(graph, keep, groups=[keep])
    assert list(executor.nests) == ["F"]
    got = executor.run(inputs)
    for name in keep:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_private_element_wise_members_are_kept_in_row_buffers() -> None:
    # F and G are read by nothing outside the nest: they go to rows of the innermost extent,
    # not to memory; the sum and the member written through a map are stored as before
    nest = shared_nest(_ops(TAIL + GRAD_D), private={"F", "G", "loss", "DG"})
    assert nest is not None
    assert nest.buffered == ("F", "G")
    assert [t.name for t in nest.outputs] == ["loss", "DG"]
    source = nest_function(nest, "tail")
    assert "float row0[10];" in source and "float row1[10];" in source
    assert "row1[(v_w_mod2 + (2 * v_w_div2))]" in source  # DG reads G from its row
    assert "out0[0] = " in source  # the loss is the first output now


def test_rows_need_outer_loops_and_a_small_row() -> None:
    flat = """
X = tensor([64])
Y[i] = X[i] * 2
Z[i] = Y[i] + Y[i] * Y[i]
"""
    nest = shared_nest(_ops(flat), private={"Y"})
    assert nest is not None and nest.buffered == ()  # no loop around the members' loops
    wide = flat.replace("[64]", "[2, 8192]").replace("[i]", "[j, i]")
    nest = shared_nest(_ops(wide), private={"Y"})
    assert nest is not None and nest.buffered == ()  # a row of 32 KiB per thread is too much
    narrow = flat.replace("[64]", "[2, 64]").replace("[i]", "[j, i]")
    nest = shared_nest(_ops(narrow), private={"Y"})
    assert nest is not None and nest.buffered == ("Y",)


@NEEDS_CC
def test_a_nest_with_row_buffers_computes_what_its_ops_compute() -> None:
    # big enough to run on several threads: each needs rows of its own (private)
    graph = neoflow.graph((TAIL + GRAD_D).replace("[2, ", "[80, ").replace("/ 960", "/ 38400"))
    rng = np.random.default_rng(5)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in graph.inputs}
    keep = ("loss", "DG")
    expected = InterpreterExecutor(graph, keep).run(inputs)
    executor = CpuExecutor(graph, keep, groups=[("F", "loss", "G", "DG")])
    nest = executor.nests["F"]
    assert nest.buffered == ("F", "G")
    assert "private(row0, row1)" in executor.source
    assert "F" not in executor.plan.offsets and "G" not in executor.plan.offsets  # no memory for them
    for _ in range(3):
        got = executor.run(inputs)
        for name in keep:
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)
    values = executor.kernel_call(["F", "loss", "G", "DG"], inputs)()
    assert set(values) == {"loss", "DG"}
    np.testing.assert_allclose(values["DG"], expected["DG"], rtol=1e-5, atol=1e-6)
