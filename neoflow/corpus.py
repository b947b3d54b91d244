"""The fusion-research corpus: every model of a directory (the repository's ``models/``) and the real
architectures of the CPU benchmark (``neoflow.architectures``, exported from PyTorch the way users
export them), planned by each policy on each target, with kernels, bytes, predicted time, the
predicted time over the ``optimal`` policy's and, where asked on a target that runs here, the
measured step times (``neoflow fuse --corpus``)."""

from __future__ import annotations

import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import onnx

from neoflow.autodiff.training import TrainSpec
from neoflow.errors import InputError
from neoflow.fusion.optimal import Optimal
from neoflow.fusion.policies import load_policy
from neoflow.ir.graph import Graph
from neoflow.runtime.compiled import compile as compile_model
from neoflow.runtime.fusing import cost_model, plan_for, planning_graph

#: the architectures' batch in the corpus (small: planning and timing a training step of each)
ARCHITECTURE_BATCH = 8
MEASURED_TARGETS = ("cpu", "cuda")


@dataclass(frozen=True)
class Entry:
    """A corpus model: its ``name`` and its ``source`` (a path or an ONNX model)."""

    name: str
    source: object


@dataclass(frozen=True)
class Row:
    """One policy's plan of one model's step on one target: kernels, bytes moved, predicted
    seconds, that over the optimum's (None without ``optimal`` among the policies), and the
    measured median step with its verdict against the first policy (None where not measured);
    ``planning`` is the seconds the policy took to plan; for ``optimal``, ``source`` says where its
    plan came from (``partition``: the integer program's; ``sliced``: that with neoflow's batch
    slicing; a heuristic's name: that heuristic's plan, which recomputes or slices below the best
    partition, ``partition_over`` times cheaper than it; with the gap where the solver's time ran out)."""

    model: str
    target: str
    policy: str
    kernels: int
    bytes: float
    predicted: float
    planning: float = 0.0
    over_optimal: float | None = None
    measured: float | None = None
    verdict: str | None = None
    source: str = ""
    partition_over: float | None = None


def default_directory() -> Path:
    """The repository's ``models/`` beside the package, else ``./models``."""
    beside = Path(__file__).resolve().parents[1] / "models"
    return beside if beside.is_dir() else Path("models")


def entries(directory: Path | None = None, architectures: bool = True) -> list[Entry]:
    """Every ``.onnx`` model of ``directory`` (default ``default_directory()``) and, with
    ``architectures`` and PyTorch installed, the four architectures at ``ARCHITECTURE_BATCH``."""
    directory = default_directory() if directory is None else Path(directory)
    if not directory.is_dir():
        raise InputError(f"no such corpus directory: '{directory}'")
    found = [Entry(path.name, path) for path in sorted(directory.glob("*.onnx"))]
    if not found:
        raise InputError(f"'{directory}' holds no .onnx model")
    if architectures:
        try:
            from neoflow.architectures import ARCHITECTURES, build, export
        except ImportError:
            return found  # no PyTorch: the directory's models only
        for name in ARCHITECTURES:
            found.append(Entry(name, _Export(name, build, export)))
    return found


class _Export:
    """An architecture exported on first use (PyTorch's exporter takes seconds per model)."""

    def __init__(self, name: str, build: Callable, export: Callable) -> None:
        self.name, self.build, self.export = name, build, export
        self.models: dict[bool, onnx.ModelProto] = {}

    def model(self, train: bool) -> onnx.ModelProto:
        if train not in self.models:
            with warnings.catch_warnings():  # the exporter's notes on in-place ops, not the user's business
                warnings.simplefilter("ignore")
                data = self.export(self.build(self.name), ARCHITECTURE_BATCH, train)
            self.models[train] = onnx.load_from_string(data)
        return self.models[train]


def _source(entry: Entry, train: bool):
    return entry.source.model(train) if isinstance(entry.source, _Export) else entry.source


def training_spec(source) -> TrainSpec:
    """Cross-entropy on a model whose output is ``[batch, classes]``, else the mean squared error."""
    graph = compile_model(source, target="interp").inference
    shape = graph.tensors[graph.outputs[0]].shape
    return TrainSpec(loss="cross_entropy" if len(shape) == 2 else "mse", optimizer="momentum")


@dataclass(frozen=True)
class Step:
    """A corpus model's step, made once for every target and policy: the model ``name``, its
    ``source``, the training ``spec`` (None: inference) and the ``graph`` a plan is made for."""

    name: str
    source: object
    spec: TrainSpec | None
    graph: Graph


def prepare(entry: Entry, train: bool) -> Step:
    """``entry``'s training step (or inference) as the graph its executors plan."""
    source = _source(entry, train)
    spec = training_spec(source) if train else None
    model = compile_model(source, target="interp", train=spec)
    if train:
        training = model.training
        graph = planning_graph(training.graph, [training.loss, *training.updates.values()])
    else:
        graph = planning_graph(model.inference, model.inference.outputs)
    return Step(entry.name, source, spec, graph)


def plan_rows(step: Step, policies: Sequence[str], target: str) -> list[Row]:
    """Each policy's plan of ``step`` on ``target``, predicted (nothing compiled or run)."""
    costs = cost_model(target)
    rows = []
    for policy in policies:
        chosen = load_policy(policy)
        started = time.perf_counter()
        plan = plan_for(step.graph, chosen, costs)
        planning = time.perf_counter() - started
        cost = costs.plan_cost(step.graph, plan)
        row = Row(step.name, target, policy, len(plan.kernels), cost.bytes, cost.seconds, planning)
        if isinstance(chosen, Optimal):
            gap = chosen.solution.gap
            source = chosen.source if gap == 0 else f"{chosen.source}, time limit: within {gap:.1%}"
            row = replace(row, source=source, partition_over=chosen.partition_seconds / cost.seconds)
        rows.append(row)
    optimum = next((r.predicted for r in rows if r.policy == "optimal"), None)
    if optimum:
        rows = [replace(r, over_optimal=r.predicted / optimum) for r in rows]
    return rows


def measure_rows(step: Step, rows: list[Row], rounds: int, seconds: float | None) -> list[Row]:
    """``rows`` (one target's) with each policy's step measured against the first's, taking turns
    (``fusion_report.compare_steps``)."""
    from neoflow.runtime.fusion_report import compare_steps, labels

    keys = labels([row.policy for row in rows])
    models = {
        key: compile_model(step.source, target=row.target, train=step.spec, fusion=row.policy)
        for key, row in zip(keys, rows, strict=True)
    }
    comparison = compare_steps(models, step.spec is not None, rounds, seconds)
    measured = []
    for row, key in zip(rows, keys, strict=True):
        against = comparison.versus.get(key)
        verdict = "baseline" if against is None else against.verdict
        measured.append(replace(row, measured=comparison.timed[key].seconds, verdict=verdict))
    return measured


def run(
    policies: Sequence[str],
    targets: Sequence[str],
    train: bool,
    directory: Path | None = None,
    architectures: bool = True,
    measure: bool = True,
    rounds: int = 7,
    seconds: float | None = None,
    progress: Callable[[str], object] = lambda line: None,
) -> list[Row]:
    """The corpus's rows: every model, target and policy (``measure``: the steps timed on the
    targets that run here)."""
    rows: list[Row] = []
    for entry in entries(directory, architectures):
        step = prepare(entry, train)
        for target in targets:
            progress(f"{entry.name} on {target}: planning")
            found = plan_rows(step, policies, target)
            if measure and target in MEASURED_TARGETS:
                progress(f"{entry.name} on {target}: compiling and timing the steps")
                found = measure_rows(step, found, rounds, seconds)
            rows += found
    return rows


def table(rows: Sequence[Row]) -> str:
    """The corpus as one markdown table."""
    measured = any(r.measured is not None for r in rows)
    optimal = any(r.over_optimal is not None for r in rows)
    columns = ["model", "target", "policy", "kernels", "MB moved", "predicted ms", "planning s"]
    columns += ["predicted / optimal", "optimal's plan"] * optimal + ["measured ms", "verdict"] * measured
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        cells = [r.model, r.target, r.policy, str(r.kernels), f"{r.bytes / 1e6:.2f}", f"{r.predicted * 1e3:.3f}"]
        cells.append(f"{r.planning:.1f}")
        if optimal:
            cells.append("-" if r.over_optimal is None else f"{r.over_optimal:.3f}x")
            cells.append(_plan_source(r))
        if measured:
            cells += ["-", "-"] if r.measured is None else [f"{r.measured * 1e3:.3f}", r.verdict or ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _plan_source(row: Row) -> str:
    """Where the ``optimal`` row's plan came from, for the table."""
    if not row.source:
        return ""
    source, _, limit = row.source.partition(", ")
    if source in ("partition", "sliced"):
        text = "best partition" + (", sliced" if source == "sliced" else "")
    else:
        text = f"{source}'s (best partition {row.partition_over:.3f}x)"
    return f"{text}, {limit}" if limit else text


def ranking(rows: Sequence[Row]) -> dict[str, dict[str, float]]:
    """Per target, each policy's geometric mean over the models of its predicted time over the
    best policy's on that model (1.0: best everywhere): the ranking a figure compares across
    targets."""
    result: dict[str, dict[str, float]] = {}
    for target in dict.fromkeys(r.target for r in rows):
        mine = [r for r in rows if r.target == target]
        best = {m: min(r.predicted for r in mine if r.model == m) for m in {r.model for r in mine}}
        for policy in dict.fromkeys(r.policy for r in mine):
            ratios = [r.predicted / best[r.model] for r in mine if r.policy == policy]
            result.setdefault(target, {})[policy] = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return result


def plot(rows: Sequence[Row], path: str | os.PathLike, title: str) -> Path:
    """One figure: per target a panel of each policy's predicted time over the best policy's, per
    model (bars) and its geometric mean (the ranking across targets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from neoflow.runtime.fusion_report import save_figure

    targets = list(dict.fromkeys(r.target for r in rows))
    policies = list(dict.fromkeys(r.policy for r in rows))
    models = list(dict.fromkeys(r.model for r in rows))
    figure, axes = plt.subplots(len(targets), 1, figsize=(max(8, 1.1 * len(models) + 3), 3.2 * len(targets)))
    axes = np.atleast_1d(axes)
    means = ranking(rows)
    width = 0.8 / len(policies)
    for axis, target in zip(axes, targets, strict=True):
        mine = [r for r in rows if r.target == target]
        for k, policy in enumerate(policies):
            values = []
            for m in models:
                best = min(r.predicted for r in mine if r.model == m)
                own = next(r.predicted for r in mine if r.model == m and r.policy == policy)
                values.append(own / best)
            label = f"{policy} (geomean {means[target][policy]:.2f}x)"
            axis.bar(np.arange(len(models)) + k * width, values, width, label=label, color=f"C{k}")
        axis.set_xticks(np.arange(len(models)) + width * (len(policies) - 1) / 2, models, rotation=20, fontsize=8)
        axis.set_ylabel("predicted / best", fontsize=9)
        axis.set_title(f"target {target}", fontsize=10)
        axis.axhline(1.0, color="k", linewidth=0.6)
        axis.legend(fontsize=7, ncol=min(len(policies), 5))
    return save_figure(figure, title, path)
