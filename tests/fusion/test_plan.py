"""Fusion plans: which tensors are stored, and the plans the code generator must refuse."""

import numpy as np
import pytest

import neoflow
from neoflow.fusion import Kernel, PlanError, apply_plan, plan_from_groups, unfused, validate
from neoflow.fusion.plan import FusionPlan

CHAIN = """
B[i] = A[i] * 2
C[i] = B[i] + 1
D[i] = C[i] * B[i]
E[i] = ReduceAdd({j}, D[j] * A[i])
"""


def _graph():
    return neoflow.graph(CHAIN, shapes={"A": (6,)})


def test_unfused_plan_stores_every_op() -> None:
    plan = unfused(_graph())
    assert [k.ops for k in plan.kernels] == [("B",), ("C",), ("D",), ("E",)]
    assert all(k.materialized == k.ops for k in plan.kernels)


def test_a_group_inlines_what_no_other_kernel_reads() -> None:
    plan = plan_from_groups(_graph(), [["B", "C", "D"], ["E"]])
    first = plan.kernel_of("C")
    assert first.materialized == ("D",) and first.inlined == ("B", "C")
    fused, groups = apply_plan(_graph(), plan)
    assert groups == (("D",), ("E",))
    assert [t.name for t in fused.op("D").inputs] == ["A"]


def test_a_tensor_read_by_another_kernel_is_stored() -> None:
    plan = plan_from_groups(_graph(), [["B", "C"], ["D", "E"]])
    assert plan.kernel_of("B").materialized == ("B", "C")


def test_an_op_in_two_groups_is_recomputed_in_each() -> None:
    plan = plan_from_groups(_graph(), [["B", "C"], ["B", "D"], ["E"]])
    assert plan.kernel_of("C").materialized == ("C",)
    kernels = [k for k in plan.kernels if "B" in k.ops]
    assert len(kernels) == 2 and all("B" in k.inlined for k in kernels)


@pytest.mark.parametrize(
    ("kernels", "message"),
    [
        ([Kernel(("B", "C", "D"), ("D",))], "ops in no kernel: E"),
        ([Kernel(("B",), ("B",)), Kernel(("C", "D", "E"), ("E",)), Kernel(("B",), ("B",))], "materialised by two"),
        ([Kernel(("B", "C"), ("C",)), Kernel(("D", "E"), ("E",))], "reads 'B', which no kernel materialises"),
        ([Kernel(("B", "C", "D"), ("C", "D")), Kernel(("E",), ())], "'E' must be kept"),
        ([Kernel(("E",), ("E",)), Kernel(("B", "C", "D"), ("D",))], "runs before"),
        ([Kernel(("B", "D"), ("B", "D")), Kernel(("C", "E"), ("C", "E"))], "depend on each other"),
        ([Kernel(("B", "C", "D", "E"), ("E",)), Kernel(("A_",), ())], "not an op of the graph"),
        ([Kernel(("B", "C", "D", "E"), ("E",), ("A_",))], "buffers ops it does not hold: A_"),
        ([Kernel(("B", "C", "D", "E"), ("D", "E"), ("D",))], "both materialises and buffers D"),
        (
            [Kernel(("B", "C", "D"), ("B", "C"), ("D",)), Kernel(("D", "E"), ("D", "E"))],
            "buffers 'D' but nothing in it reads 'D'",
        ),
    ],
)
def test_invalid_plans_are_refused_with_the_reason(kernels, message) -> None:
    with pytest.raises(PlanError, match=message):
        validate(FusionPlan(tuple(kernels)), _graph())


def test_an_inlined_scatter_add_is_refused() -> None:
    graph = neoflow.graph("B[i] = A[i] + 1\nC[i] = B[i] * 2", shapes={"A": (4,)})
    from dataclasses import replace

    scatter = replace(graph.ops[0], scatter=(graph.ops[0].body.a.indices[0],))
    graph = replace(graph, ops=(scatter, graph.ops[1]))
    with pytest.raises(PlanError, match="scatter-add"):
        validate(FusionPlan((Kernel(("B", "C"), ("C",)),)), graph)


def test_the_error_is_one_line() -> None:
    with pytest.raises(PlanError) as info:
        validate(FusionPlan((Kernel(("B",), ("B",)),)), _graph())
    assert str(info.value).startswith("fusion plan error: ") and "\n" not in str(info.value)


def test_an_op_read_inside_an_index_is_stored_not_inlined() -> None:
    graph = neoflow.graph("I = tensor([5], int64)\nI[i] = (i * 2) % 5\nY[i] = X[I[i]] * 2", shapes={"X": (5,)})
    with pytest.raises(PlanError, match="reads 'I' inside an index"):
        validate(FusionPlan((Kernel(("I", "Y"), ("Y",)),)), graph)
    plan = plan_from_groups(graph, [["I", "Y"]])
    assert plan.kernels == (Kernel(("I", "Y"), ("I", "Y")),)
    fused, _ = apply_plan(graph, plan)
    x = np.arange(5, dtype=np.float32)
    np.testing.assert_array_equal(neoflow.evaluate(fused, {"X": x})["Y"], x[(np.arange(5) * 2) % 5] * 2)


def test_an_op_two_ops_of_a_nest_read_is_buffered_where_the_nest_keeps_it() -> None:
    # B is read by C and D in one kernel: given a target whose loop nest keeps it in a tile
    # buffer it is buffered (computed once); where the nest would not keep it, it is inlined
    keeps_all = plan_from_groups(_graph(), [["B", "C", "D"], ["E"]], nests=lambda ops, private: tuple(private))
    kernel = keeps_all.kernel_of("B")
    assert kernel.buffered == ("B",) and kernel.inlined == ("C",) and kernel.materialized == ("D",)
    fused, groups = apply_plan(_graph(), keeps_all)
    assert groups == (("B", "D"), ("E",))  # the buffered op is computed in the kernel, C substituted into D
    assert [t.name for t in fused.op("D").inputs] == ["B"]
    keeps_none = plan_from_groups(_graph(), [["B", "C", "D"], ["E"]], nests=lambda ops, private: ())
    assert keeps_none.kernel_of("B").buffered == () and keeps_none.kernel_of("B").inlined == ("B", "C")
    no_nest = plan_from_groups(_graph(), [["B", "C", "D"], ["E"]], nests=lambda ops, private: None)
    assert no_nest.kernel_of("B").buffered == ()


CONCAT = """
E = tensor([4, 5])
F = tensor([7, 5])
L = tensor([7, 5])
G = tensor([PARTS, 5])
E[c, i] = D[c, i] * 2
F[c, i] = Select(c < 3, A[c, i], E[c - 3, i])
L[c, i] = F[c, i] * F[c, i] + 1
G[c, i] = F[c, i] + 1
"""


@pytest.mark.parametrize("parts", [3, 4])
def test_a_producer_a_recomputing_group_no_longer_reads_is_not_stored(parts: int) -> None:
    # the second group recomputes the concatenation F for its first `parts` rows: within the
    # first 3 that is A alone, so E need not be stored for it; one row more reads E
    graph = neoflow.graph(CONCAT.replace("PARTS", str(parts)), shapes={"A": (3, 5), "D": (4, 5)})
    plan = plan_from_groups(graph, [["E", "F", "L"], ["F", "G"]])
    validate(plan, graph)
    assert plan.kernel_of("L").materialized == (("L",) if parts == 3 else ("E", "L"))
    fused, _ = apply_plan(graph, plan)
    assert [t.name for t in fused.op("G").inputs] == (["A"] if parts == 3 else ["A", "E"])
    rng = np.random.default_rng(0)
    inputs = {"A": rng.standard_normal((3, 5)).astype(np.float32), "D": rng.standard_normal((4, 5)).astype(np.float32)}
    expected = neoflow.evaluate(graph, inputs)
    got = neoflow.evaluate(fused, inputs)
    for name in ("L", "G"):
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-6)


def test_kernels_are_ordered_by_what_they_read_once_their_recomputed_ops_are_inlined() -> None:
    # the first group recomputes F for its first 3 rows (A alone there) and stores G, which the
    # second reads; by the graph's edges the first would also need E, stored by the second: a cycle
    text = """
    E = tensor([4, 5])
    F = tensor([7, 5])
    G = tensor([3, 5])
    L = tensor([7, 5])
    E[c, i] = D[c, i] * 2
    F[c, i] = Select(c < 3, A[c, i], E[c - 3, i])
    G[c, i] = F[c, i] + 1
    L[c, i] = F[c, i] * G[c % 3, i]
    """
    graph = neoflow.graph(text, shapes={"A": (3, 5), "D": (4, 5)})
    plan = plan_from_groups(graph, [["E", "F", "L"], ["F", "G"]], keep=("E",))
    validate(plan, graph, keep=("E",))
    assert [k.materialized for k in plan.kernels] == [("G",), ("E", "L")]
    fused, _ = apply_plan(graph, plan)
    rng = np.random.default_rng(1)
    inputs = {"A": rng.standard_normal((3, 5)).astype(np.float32), "D": rng.standard_normal((4, 5)).astype(np.float32)}
    expected = neoflow.evaluate(graph, inputs)
    np.testing.assert_allclose(neoflow.evaluate(fused, inputs)["L"], expected["L"], rtol=1e-6)


def test_independent_kernels_run_in_the_graph_order_of_their_own_first_op() -> None:
    # the capsule network's backward pass: an input gradient (a contraction with its mask fused
    # after it) and a weight gradient, both reading dY; the policy lists the weight gradient first
    text = """
    X2[i, k] = X[i, k] * 2
    dA[i, j] = ReduceAdd({k}, dY[i, k] * X2[i, k] * W[j, k])
    dX[i, j] = Select(A[i, j] > 0, dA[i, j], 0)
    dW[k, m] = ReduceAdd({i}, dY[i, k] * X2[i, m])
    """
    graph = neoflow.graph(text, shapes={"X": (4, 3), "dY": (4, 3), "W": (5, 3), "A": (4, 5)})
    assert [op.name for op in graph.ops] == ["X2", "dA", "dX", "dW"]
    # X2, recomputed in both kernels, places neither
    plan = plan_from_groups(graph, [["X2", "dW"], ["X2", "dA", "dX"]])
    assert [k.materialized for k in plan.kernels] == [("dX",), ("dW",)]
    # a kernel still follows the kernels it reads: here both read X2, stored
    plan = plan_from_groups(graph, [["dW"], ["dA", "dX"], ["X2"]])
    assert [k.materialized for k in plan.kernels] == [("X2",), ("dX",), ("dW",)]


def test_a_chain_whose_inlining_would_grow_exponentially_stores_its_big_ops(monkeypatch) -> None:
    """Each op reads the one before three times: inlining all 8 into the last would give an
    expression of 3^8 reads.  Past ``INLINE_NODES`` nodes (lowered here, so the unbounded plan
    stays quick to make and fails the checks rather than hanging) the producer is stored instead,
    and the kernel still computes the chain."""
    import neoflow.fusion.plan as plan_module

    bound = 60
    monkeypatch.setattr(plan_module, "INLINE_NODES", bound)
    levels = 8
    text = "\n".join(f"A{k + 1}[i] = A{k}[i] * A{k}[i] - A{k}[i] * 0.5" for k in range(levels))
    graph = neoflow.graph(text, shapes={"A0": (8,)})
    plan = plan_from_groups(graph, [[op.name for op in graph.ops]])
    fused, _ = apply_plan(graph, plan)
    kernel = plan.kernels[0]
    assert f"A{levels}" in kernel.materialized and len(kernel.materialized) > 1  # some big producers stored
    assert all(sum(1 for _ in op.body.walk()) <= 3 * bound for op in fused.ops)
    x = np.random.default_rng(0).uniform(-0.5, 0.5, 8).astype(np.float32)
    want = x
    for _ in range(levels):
        want = want * want - want * np.float32(0.5)
    got = neoflow.compile(fused, target="interp", fusion="none").run({"A0": x})
    np.testing.assert_allclose(got[f"A{levels}"], want, rtol=1e-5, atol=1e-7)


def test_shifted_holders_answer_as_holders_of_the_groups_a_move_leaves() -> None:
    from neoflow.fusion.plan import ShiftedHolders, holders

    groups = [frozenset("ab"), frozenset("c"), frozenset("bd"), frozenset("e"), frozenset("af")]
    for removed, added in [({1, 3}, [frozenset("ce")]), ({0}, [frozenset("abx"), frozenset("a")]), (set(), [])]:
        after = [g for k, g in enumerate(groups) if k not in removed] + added
        shifted = ShiftedHolders(holders(groups), removed, len(groups), added)
        expected = holders(after)
        for name in "abcdefx":
            assert shifted.get(name, ()) == expected.get(name, []) or (name not in expected and not shifted.get(name))
            if name in expected:
                assert shifted[name] == expected[name]
