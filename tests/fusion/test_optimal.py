"""The exact baseline policy: its integer program finds the cheapest partition (checked against
brute force), never costs more than a heuristic's plan under the model, and its plan is valid and
computes what ``none`` computes."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.fusion import BUILT_IN
from neoflow.fusion.optimal import Optimal, _cycles, _Reach, connected_groups, solve
from neoflow.fusion.plan import Grouping, validate
from neoflow.runtime.fusing import cost_model, planning_graph

MODELS = Path(__file__).resolve().parents[2] / "models"


def _graph(name: str, train: bool):
    model = neoflow.compile(MODELS / f"{name}.onnx", target="interp", train=neoflow.TrainSpec() if train else None)
    if not train:
        return model.inference
    keep = [model.training.loss, *model.training.updates.values()]
    return planning_graph(model.training.graph, keep)


def test_connected_groups_of_a_chain_are_its_intervals() -> None:
    graph = neoflow.graph("A = tensor([8])\nB[i] = A[i] * 2\nC[i] = B[i] + 1\nD[i] = C[i] * C[i]\nE[i] = D[i] - 3")
    groups, complete = connected_groups(graph, 4)
    names = [op.name for op in graph.ops]
    intervals = {frozenset(names[a:b]) for a in range(4) for b in range(a + 1, 5)}
    assert complete and len(groups) == len(set(groups)) == 10 and set(groups) == intervals
    assert len(connected_groups(graph, 2)[0]) == 7  # 4 singletons and 3 pairs
    assert connected_groups(graph, 4, limit=5) == (groups[:5], False)


def _set_partitions(items: list[str]):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for partition in _set_partitions(rest):
        yield [[first], *partition]
        for k in range(len(partition)):
            yield [*partition[:k], [first, *partition[k]], *partition[k + 1 :]]


@pytest.mark.parametrize(("name", "train"), [("cnn", False), ("capsule", False), ("upsampler", False)])
def test_the_program_finds_the_cheapest_partition_brute_force_finds(name: str, train: bool) -> None:
    graph = _graph(name, train)
    model = cost_model("tensorcore")
    grouping, reach = Grouping(graph, nests=model.nests), _Reach(graph)
    best = float("inf")
    for partition in _set_partitions([op.name for op in graph.ops]):
        groups = [frozenset(g) for g in partition]
        if not all(reach.convex(g) for g in groups) or _cycles(groups, grouping.readers):
            continue
        kernels = [grouping.kernel_alone(g) for g in groups]
        best = min(best, sum(model.kernel_cost(graph, k).seconds for k in kernels))
    solution = solve(graph, model)
    assert solution.proven and solution.complete
    assert solution.seconds == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("target", ["cpu", "tensorcore", "npu"])
@pytest.mark.parametrize(("name", "train"), [("mlp", True), ("cnn", False), ("cnn", True), ("capsule", True)])
def test_the_optimum_never_costs_more_than_a_heuristic(name: str, train: bool, target: str) -> None:
    graph = _graph(name, train)
    model = cost_model(target)
    policy = Optimal()
    plan = policy.plan(graph, model)
    validate(plan, graph)
    optimum = model.plan_cost(graph, plan).seconds
    for heuristic in BUILT_IN.values():
        assert optimum <= model.plan_cost(graph, heuristic().plan(graph, model)).seconds * (1 + 1e-9)
    assert policy.solution.proven and "optimal" in plan.notes


def test_the_optimal_plan_computes_what_none_computes(target: str) -> None:
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((32, 1, 8, 8)).astype(np.float32), "labels": rng.integers(0, 10, 32)}
    spec = neoflow.TrainSpec(optimizer="adam", lr=1e-2)
    reference = neoflow.compile(MODELS / "cnn.onnx", target="interp", train=spec)
    model = neoflow.compile(MODELS / "cnn.onnx", target=target, train=spec, fusion="optimal")
    assert model._train.fusion_plan.policy == "optimal"
    assert model.train_step(batch) == pytest.approx(reference.train_step(batch), rel=1e-5)
    for name, value in reference.parameters().items():
        np.testing.assert_allclose(model.parameters()[name], value, rtol=2e-4, atol=1e-5, err_msg=name)


def test_groups_depending_on_each_other_are_found() -> None:
    readers = {"a1": ["b1"], "b2": ["a2"], "b1": ["c"]}
    groups = [frozenset({"a1", "a2"}), frozenset({"b1", "b2"}), frozenset({"c"})]
    assert [sorted(cycle) for cycle in _cycles(groups, readers)] == [[0, 1]]
    assert _cycles([frozenset({"a1"}), frozenset({"b1", "c"})], readers) == []


def test_optimal_loads_by_name_and_says_what_it_needs(monkeypatch) -> None:
    from neoflow.errors import CompileError
    from neoflow.fusion import load_policy

    assert isinstance(load_policy("optimal"), Optimal)
    assert list(itertools.islice(_set_partitions(["a", "b"]), 3)) == [[["a"], ["b"]], [["a", "b"]]]
    monkeypatch.setitem(sys.modules, "scipy.optimize", None)  # as where scipy is not installed
    with pytest.raises(CompileError, match=r"needs scipy \(pip install 'neoflow\[research\]'\)"):
        solve(_graph("mlp", False), cost_model("interp"))
