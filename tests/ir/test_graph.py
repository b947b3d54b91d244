"""Graph look-ups: an op by the tensor it defines and its position, worked out once."""

from __future__ import annotations

import pickle

import pytest

import neoflow
from neoflow.fusion.plan import Kernel, kernel_ops
from neoflow.ir.graph import Graph


def _chain() -> Graph:
    first = neoflow.op("A[i] = X[i] * 2", shapes={"X": (4,)})
    second = neoflow.op("B[i] = A[i] + 1", shapes={"A": (4,)})
    third = neoflow.op("C[i] = B[i] * A[i]", shapes={"A": (4,), "B": (4,)})
    return Graph.from_ops([first, second, third])


def test_an_op_is_found_by_the_tensor_it_defines_and_its_position() -> None:
    graph = _chain()
    assert [graph.op(name).name for name in ("A", "B", "C")] == ["A", "B", "C"]
    assert graph.positions == {"A": 0, "B": 1, "C": 2}
    with pytest.raises(KeyError):
        graph.op("X")  # an input: no op defines it
    again = pickle.loads(pickle.dumps(graph))  # the look-ups worked out travel with it or are made again
    assert again == graph and again.op("C").name == "C"


def test_a_kernels_ops_come_in_graph_order_whatever_order_it_lists() -> None:
    graph = _chain()
    listed = Kernel(("C", "A", "B"), ("C",))  # A and B recomputed inside C
    (fused,) = kernel_ops(graph, listed)
    assert fused.name == "C" and {t.name for t in fused.inputs} == {"X"}
