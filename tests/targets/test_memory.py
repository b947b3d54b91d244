"""Liveness planning: tensors die at their last use; peak live memory is below the naive total."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.targets.memory import nbytes, plan_memory

MODELS_DIR = Path(__file__).resolve().parents[2] / "models"


def test_chain_frees_each_tensor_after_its_reader() -> None:
    graph = neoflow.graph(
        """X = tensor([256])
        A[i] = X[i] * 2
        B[i] = A[i] + 1
        C[i] = B[i] * B[i]
        D[i] = C[i] - X[i]
        """
    )
    plan = plan_memory(graph, keep=["D"])
    freed = {name: k for k, names in enumerate(plan.free_after) for name in names}
    assert freed == {"A": 1, "B": 2, "C": 3, "X": 3}
    size = 256 * 4
    # at most three buffers are live at once (X, a producer's input and its output)
    assert plan.peak_bytes == 3 * size
    assert plan.naive_bytes == 5 * size
    # A and C never live together, so the arena reuses A's buffer
    assert plan.arena_bytes == 2 * size


def test_arena_offsets_never_overlap_while_live() -> None:
    model = neoflow.compile(MODELS_DIR / "cnn.onnx", train=neoflow.TrainSpec(labels="y"))
    graph = model.training.graph
    plan = model.memory["training"]
    position = {op.name: k for k, op in enumerate(graph.ops)}
    death = {name: k for k, names in enumerate(plan.free_after) for name in names}
    spans = {
        name: (position[name], death.get(name, len(graph.ops)), offset, nbytes(graph.tensors[name]))
        for name, offset in plan.offsets.items()
    }
    items = list(spans.items())
    for i, (a, (sa, da, oa, na)) in enumerate(items):
        assert oa % 64 == 0
        for b, (sb, db, ob, nb) in items[i + 1 :]:
            if sa <= db and sb <= da:
                assert oa + na <= ob or ob + nb <= oa, (a, b)


@pytest.mark.parametrize(
    ("model", "spec", "parameters"),
    [
        ("mlp.onnx", neoflow.TrainSpec(labels="y"), None),
        ("cnn.onnx", neoflow.TrainSpec(labels="y", optimizer="adam"), None),
        ("capsule.onnx", neoflow.TrainSpec(labels="y", optimizer="momentum"), None),
        ("upsampler.onnx", neoflow.TrainSpec(loss="mse", labels="target"), None),
        ("four_op.nf", neoflow.TrainSpec(loss="mse", labels="target"), {"A": np.zeros((1, 3, 224, 224), np.float32)}),
    ],
)
def test_peak_live_memory_is_below_the_naive_total(model, spec, parameters) -> None:
    compiled = neoflow.compile(MODELS_DIR / model, train=spec, parameters=parameters)
    for kind, plan in compiled.memory.items():
        assert plan.peak_bytes < plan.naive_bytes, kind
    assert "peak live memory" in compiled.report()
