"""Inlining a producer into its reader gives the same values as running both."""

import numpy as np
import pytest

import neoflow
from neoflow.errors import CompileError
from neoflow.fusion.inline import inline, inline_all
from neoflow.ir import Graph, evaluate, evaluate_graph

CHAIN = """
B[i] = A[i] * 2
C[i] = B[i] + 1
D[i] = C[i] * C[i]
"""


def _graph(text: str, **shapes) -> Graph:
    return neoflow.graph(text, shapes={k: tuple(v) for k, v in shapes.items()})


def test_padding_inlined_into_a_convolution_reads_the_unpadded_input() -> None:
    graph = _graph(
        """
        P = tensor([2, 8, 8])
        P[c, h, w] = Select(h >= 1 && h < 7 && w >= 1 && w < 7, X[c, h - 1, w - 1], 0)
        Y[k, p, q] = ReduceAdd({c, r, s}, P[c, p + r, q + s] * W[k, c, r, s])
        """,
        X=(2, 6, 6),
        W=(3, 2, 3, 3),
    )
    pad, conv = graph.ops
    fused = inline(conv, pad)
    assert [t.name for t in fused.inputs] == ["X", "W"]
    rng = np.random.default_rng(0)
    shapes = {"X": (2, 6, 6), "W": (3, 2, 3, 3)}
    inputs = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    expected = evaluate_graph(graph, inputs)["Y"]
    np.testing.assert_allclose(evaluate(fused, inputs), expected, rtol=1e-5, atol=1e-5)


def test_a_reduction_inlined_twice_gets_fresh_axis_names() -> None:
    graph = _graph(
        """
        S[i] = ReduceAdd({k}, A[i, k])
        T[i, k] = S[i] * S[3 - i] + B[i, k]
        """,
        A=(4, 5),
        B=(4, 5),
    )
    sums, reader = graph.ops
    fused = inline(reader, sums)
    names = [name for name, _ in fused.ranges]
    assert len(names) == len(set(names)) == 4  # i, k and one fresh axis per inlined read
    rng = np.random.default_rng(1)
    inputs = {name: rng.standard_normal((4, 5)).astype(np.float32) for name in "AB"}
    np.testing.assert_allclose(evaluate(fused, inputs), evaluate_graph(graph, inputs)["T"], rtol=1e-5)


def test_a_chain_of_inlined_ops_leaves_only_the_stored_ones() -> None:
    graph = _graph(CHAIN, A=(8,))
    (fused,) = inline_all(graph.ops, ["B", "C"])
    assert fused.name == "D" and [t.name for t in fused.inputs] == ["A"]
    a = np.arange(8, dtype=np.float32)
    np.testing.assert_allclose(evaluate(fused, {"A": a}), (a * 2 + 1) ** 2)


def test_a_memo_reuses_an_ops_substituted_form_only_for_the_same_inlined_producers() -> None:
    graph = _graph(CHAIN, A=(8,))
    memo: dict = {}
    both = inline_all(graph.ops, ["B", "C"], memo)
    assert both == inline_all(graph.ops, ["B", "C"]) and ("D", frozenset({"B", "C"})) in memo
    # C alone inlined: D's form reaches C only, and C's keeps its read of B
    (stored_b, only_c) = inline_all(graph.ops, ["C"], memo)
    assert stored_b.name == "B" and [t.name for t in only_c.inputs] == ["B"]
    assert inline_all(graph.ops, ["B", "C"], memo)[0] is both[0]  # reused, not rebuilt


def test_a_narrowing_producer_keeps_its_rounding() -> None:
    graph = _graph("H[i] = float16(A[i] / 3)\nY[i] = H[i] * 3", A=(4,))
    fused = inline(graph.ops[1], graph.ops[0])
    a = np.array([1, 2, 10, 1000.7], np.float32)
    np.testing.assert_array_equal(evaluate(fused, {"A": a}), evaluate_graph(graph, {"A": a})["Y"])


def test_a_scatter_add_cannot_be_inlined() -> None:
    from dataclasses import replace

    graph = _graph("B[i] = A[i] + 1\nC[i] = B[i] * 2", A=(4,))
    scatter = replace(graph.ops[0], scatter=(graph.ops[0].body.a.indices[0],))
    with pytest.raises(CompileError, match="scatter-add"):
        inline(graph.ops[1], scatter)


RELU6 = """
Y[i] = min(max(X[i], 0.0), 6.0)
dX[i] = G[i] * (Select(Y[i] < 6.0, 1, 0) * Select(X[i] > 0.0, 1, 0))
"""


def test_a_clamp_whose_input_is_read_anyway_is_recomputed_not_read() -> None:
    from neoflow.fusion.inline import recompute_from_reads

    # a ReLU6's derivative reads the clipped tensor and its input: the input alone suffices
    graph = _graph(RELU6, X=[64], G=[64])
    producers = {op.name: op for op in graph.ops}
    derivative = recompute_from_reads(producers["dX"], producers)
    assert [t.name for t in derivative.inputs] == ["G", "X"]
    assert "min(" not in str(derivative) and "max(" not in str(derivative)  # [X < 6], not [clip(X) < 6]
    x = np.array([-1.0, 0.0, 0.5, 5.9, 6.0, 7.0, np.nan] * 9 + [3.0], np.float32)
    g = np.arange(64, dtype=np.float32)
    values = evaluate_graph(graph, {"X": x, "G": g})
    np.testing.assert_array_equal(evaluate(derivative, {"X": x, "G": g}), values["dX"])
    # not where the input is not read already, nor a producer that sums
    alone = _graph("Y[i] = min(max(X[i], 0.0), 6.0)\nZ[i] = G[i] * Select(Y[i] < 6.0, 1, 0)", X=[8], G=[8])
    ops = {op.name: op for op in alone.ops}
    assert recompute_from_reads(ops["Z"], ops) is ops["Z"]
    summed = _graph("S[i] = ReduceAdd({k}, X[i, k])\nZ[i] = S[i] * X[i, 0]", X=[8, 4])
    ops = {op.name: op for op in summed.ops}
    assert recompute_from_reads(ops["Z"], ops) is ops["Z"]


def test_plans_recompute_clamps_from_what_they_read_except_the_unfused_plan() -> None:
    from neoflow.fusion.cost import CostModel
    from neoflow.fusion.plan import apply_plan
    from neoflow.fusion.policies import load_policy

    # Y kept (an output): every plan stores it, and only the fused plan's derivative stops reading it
    graph = neoflow.graph(RELU6, shapes={"X": (64,), "G": (64,)}, outputs=["Y", "dX"])
    for policy, reads in (("none", ["G", "Y", "X"]), ("elementwise", ["G", "X"]), ("neoflow", ["G", "X"])):
        plan = load_policy(policy).plan(graph, CostModel())
        fused, _ = apply_plan(graph, plan)
        derivative = next(op for op in fused.ops if op.name == "dX")
        assert [t.name for t in derivative.inputs] == reads, policy
