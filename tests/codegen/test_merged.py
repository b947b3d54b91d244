"""Point-wise ops over short inner extents: lowered over merged trailing dimensions."""

from __future__ import annotations

import numpy as np
import pytest

import neoflow
from neoflow.codegen.merged import merged_inner, merged_shape
from neoflow.ir.expr import Read
from neoflow.targets.cpu.executor import CpuExecutor
from neoflow.targets.cpu.lower import lower_op
from neoflow.targets.cpu.nest import shared_nest
from tests.on_targets import NEEDS_CC, assert_compiled_matches_interpreter

WEIGHT = (64, 64, 3, 3)
# an optimizer's moment and parameter updates of a capsule weight: one nest
MOMENTUM_STEP = """
P = tensor([4, 4, 3, 3, 2, 2])
G = tensor([4, 4, 3, 3, 2, 2])
M = tensor([4, 4, 3, 3, 2, 2])
M2[a, b, c, d, e, f] = 0.9 * M[a, b, c, d, e, f] + 0.1 * G[a, b, c, d, e, f]
P2[a, b, c, d, e, f] = P[a, b, c, d, e, f] - 0.01 * M2[a, b, c, d, e, f]
"""


def _update(shape: tuple[int, ...] = WEIGHT):
    """An Adam-like update: every tensor read at the op's point, the step size a scalar."""
    letters = "abcdefgh"[: len(shape)]
    point = ", ".join(letters)
    text = f"Y[{point}] = X[{point}] - L[] * G[{point}] / (sqrt(V[{point}]) + 1e-8)"
    return neoflow.op(text, shapes={"X": shape, "G": shape, "V": shape, "L": ()})


@pytest.mark.parametrize(
    ("shape", "merged"),
    [
        ((64, 64, 3, 3), (64, 576)),
        ((4, 4, 3, 3, 2, 2), (4, 144)),  # the capsule network's second kernel, 2 x 2 poses
        ((3, 5), (15,)),  # all of it is shorter than one inner loop: one loop
        ((1, 19, 224, 224), None),  # inner loops long enough already
        ((100,), None),
        ((0, 3), None),  # nothing to loop over
    ],
)
def test_trailing_dimensions_merge_into_an_inner_extent_of_at_least_64(shape, merged) -> None:
    assert merged_shape(shape) == merged


def test_a_point_wise_op_runs_over_its_merged_shape() -> None:
    op = merged_inner(_update())
    assert op.shape == (64, 576) and op.indices == ("a", "b")
    assert {t.name: t.shape for t in op.inputs} == {"X": (64, 576), "L": (), "G": (64, 576), "V": (64, 576)}
    assert "c1 <= 575" in lower_op(_update(), "kernel")  # one inner loop of 576


@pytest.mark.parametrize(
    ("text", "shapes"),
    [
        ("Y[a, b, c] = X[a, b, c] + B[c]", {"X": (8, 4, 3), "B": (3,)}),  # a broadcast read
        ("Y[a, b, c] = X[a, c, b]", {"X": (8, 3, 3)}),  # a transposed read
        ("Y[a, b, c] = Select(c > 0, X[a, b, c], 0)", {"X": (8, 4, 3)}),  # an index used as a value
        ("Y[a, b] = ReduceAdd({c}, X[a, b, c])", {"X": (8, 4, 3)}),  # a reduction
    ],
)
def test_ops_reading_anything_but_their_own_point_keep_their_shape(text: str, shapes: dict) -> None:
    assert merged_inner(neoflow.op(text, shapes=shapes)) is None


@NEEDS_CC
@pytest.mark.parametrize("shape", [WEIGHT, (4, 4, 3, 3, 2, 2), (3, 5)])
def test_a_merged_op_computes_what_the_interpreter_does(shape: tuple[int, ...]) -> None:
    op = _update(shape)
    rng = np.random.default_rng(1)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}
    inputs["V"] = np.abs(inputs["V"])
    got = neoflow.compile(op, target="cpu").run(inputs)
    np.testing.assert_allclose(got, neoflow.evaluate(op, inputs), rtol=1e-5, atol=1e-5)
    assert got.shape == shape


def test_a_nest_of_point_wise_ops_runs_over_their_merged_shape_and_keeps_the_graph_shapes() -> None:
    graph = neoflow.graph(MOMENTUM_STEP)
    nest = shared_nest(list(graph.ops))
    assert nest.extents == (4, 144)
    assert {t.name: t.shape for t in (*nest.inputs, *nest.outputs)} == {
        name: (4, 4, 3, 3, 2, 2) for name in ("M", "G", "P", "M2", "P2")
    }


@NEEDS_CC
def test_a_merged_nest_computes_what_the_interpreter_does() -> None:
    graph = neoflow.graph(MOMENTUM_STEP)
    rng = np.random.default_rng(2)
    inputs = {name: rng.standard_normal((4, 4, 3, 3, 2, 2)).astype(np.float32) for name in ("P", "G", "M")}
    executor = CpuExecutor(graph, keep=("M2", "P2"), groups=[("M2", "P2")])
    assert executor.nests  # the two updates run as one nest
    got = executor.run(inputs)
    m2 = 0.9 * inputs["M"] + 0.1 * inputs["G"]
    np.testing.assert_allclose(got["M2"], m2, rtol=1e-6)
    np.testing.assert_allclose(got["P2"], inputs["P"] - 0.01 * m2, rtol=1e-6, atol=1e-7)
    assert got["P2"].shape == (4, 4, 3, 3, 2, 2)


@NEEDS_CC
def test_reads_outside_the_merged_dimensions_keep_their_indices() -> None:
    """A BatchNorm over 8x8 maps reads its per-channel scale at the channel alone: the maps merge into
    one inner loop of 64 and the scale is read as before; a read of a merged dimension stops it."""
    norm = neoflow.op("Y[n, c, h, w] = (X[n, c, h, w] - M[c]) * S[c]", shapes={"X": (2, 3, 8, 8), "M": (3,), "S": (3,)})
    merged = merged_inner(norm)
    assert merged is not None and merged.shape == (2, 3, 64)
    reads = {n.tensor: tuple(str(i) for i in n.indices) for n in merged.body.walk() if isinstance(n, Read)}
    assert reads["M"] == reads["S"] == ("c",) and len(reads["X"]) == 3
    assert_compiled_matches_interpreter(norm, 3)
    by_column = neoflow.op("Y[n, c, h, w] = X[n, c, h, w] * S[w]", shapes={"X": (2, 3, 8, 8), "S": (8,)})
    assert merged_inner(by_column) is None
