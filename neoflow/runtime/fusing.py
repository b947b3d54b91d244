"""Fusion in the runtime: plan a graph with a policy, apply the plan, build the executor.

The executor runs the fused graph (one op per materialised tensor, inlined
producers substituted) kernel by kernel; it keeps the plan and the cost model
for whoever reports on them."""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from neoflow import targets
from neoflow.codegen.hardware import hardware
from neoflow.fusion.cost import CostModel
from neoflow.fusion.plan import FusionPlan, apply_plan, validate
from neoflow.fusion.policies import FusionPolicy, load_policy
from neoflow.fusion.slicing import SliceRun
from neoflow.ir.graph import Graph
from neoflow.runtime.resources import check_resources

DEFAULT_POLICY = "none"


def cost_model(target: str) -> CostModel:
    """The cost model ``target`` plans with (its own estimates, handed to fusion), knowing the
    target's name and hardware description (``CostModel.target``, ``CostModel.hardware``)."""
    found = targets.target(target)
    model = found.cost_model()
    model.target = found.name
    model.hardware = hardware(found.hardware) if found.hardware is not None else None
    return model


def planning_graph(graph: Graph, keep: Collection[str]) -> Graph:
    """``graph`` with the tensors the caller keeps as its outputs: a plan must
    materialise them, and need not store an output of ``graph`` nobody keeps
    (a training step's prediction when the step does not hand it back)."""
    return dataclasses.replace(graph, outputs=tuple(dict.fromkeys(keep)))


def plan_for(graph: Graph, fusion: str | FusionPolicy, model: CostModel) -> FusionPlan:
    """The plan ``fusion`` makes for ``graph`` (a ``planning_graph``; checked with ``validate``)."""
    policy = load_policy(fusion)
    plan = policy.plan(graph, model)
    validate(plan, graph)
    if not plan.policy:
        plan = dataclasses.replace(plan, policy=getattr(policy, "name", type(policy).__name__))
    return plan


def slice_runs(plan: FusionPlan, groups: Sequence[Sequence[str]]) -> list[SliceRun]:
    """The sliced kernels of ``plan`` as an executor runs them, ``groups`` the fused
    graph's op names of each kernel (``apply_plan``)."""
    return [
        SliceRun(tuple(group), kernel.sliced, kernel.buffered)
        for kernel, group in zip(plan.kernels, groups, strict=True)
        if kernel.sliced
    ]


def build_executor(
    target: str,
    graph: Graph,
    keep: Collection[str],
    fusion: str | FusionPolicy = DEFAULT_POLICY,
    precision: str | None = None,
):
    """An executor of ``target`` running ``graph`` fused by policy ``fusion`` (contractions in
    ``precision`` where the target has tensor cores; None: its default);
    it carries ``fusion_plan``, the ``planned_graph`` it was made for (``graph``
    with ``keep`` as its outputs), ``kernel_groups`` and ``cost_model``.  A graph past this machine's
    memory or the time limit (``runtime.resources``) is a ``ResourceError`` before any planning."""
    model = cost_model(target)
    check_resources(graph, target, lambda: model.machine.peak_flops if model.machine.measured else None)
    planned = planning_graph(graph, keep)
    plan = plan_for(planned, fusion, model)
    fused, groups = apply_plan(planned, plan)
    options = {} if precision is None else {"precision": precision}
    executor = targets.target(target).executor(fused, keep, groups, slice_runs(plan, groups), **options)
    executor.fusion_plan = plan
    executor.kernel_groups = groups
    executor.planned_graph = planned
    executor.cost_model = model
    return executor
