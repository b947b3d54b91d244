"""What a fusion plan does to a model: per kernel, its ops, what it stores and
recomputes, its arithmetic, bytes, predicted and measured time; one policy
against another.  ``neoflow fuse`` prints these."""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from neoflow.runtime.timing import Timed, Versus, interleaved_rounds, timed, versus

if TYPE_CHECKING:
    from neoflow.fusion.plan import FusionPlan
    from neoflow.runtime.compiled import CompiledModel


@dataclass(frozen=True)
class KernelRow:
    """One kernel of a plan: ``recomputed`` are its inlined ops (computed in
    their readers' loops, never stored), ``buffered`` the ones it keeps in a
    tile buffer (computed once, never stored); times in seconds."""

    name: str
    ops: tuple[str, ...]
    materialized: tuple[str, ...]
    recomputed: tuple[str, ...]
    flops: float
    bytes: float
    predicted: float
    measured: float
    buffered: tuple[str, ...] = ()


@dataclass(frozen=True)
class PolicyReport:
    """A policy's plan of one model's step (``"inference"`` or ``"training
    step"``): its kernels and the measured median time of the whole step."""

    policy: str
    step: str
    rows: tuple[KernelRow, ...]
    step_seconds: float
    target: str
    notes: Mapping[str, str] = field(default_factory=dict)

    @property
    def bytes(self) -> float:
        return sum(r.bytes for r in self.rows)

    @property
    def flops(self) -> float:
        return sum(r.flops for r in self.rows)

    @property
    def predicted(self) -> float:
        return sum(r.predicted for r in self.rows)


def time_kernels(executor, feed: Mapping[str, np.ndarray], repeats: int = 5) -> list[float]:
    """Median seconds of each kernel of ``executor``'s fusion plan (its
    ``kernel_groups``), run alone ``repeats`` times on the values the kernels
    before it produced (``feed``: every graph input), after one untimed run of
    the whole graph and one of the kernel.  Only the kernel is timed
    (``kernel_call``: its inputs converted and its outputs allocated beforehand),
    so that a kernel of a few microseconds is not measured as the Python around it."""
    executor.run(feed)  # once untimed: threads started, pages touched
    values = dict(feed)
    seconds = []
    for group in executor.kernel_groups:
        call = executor.kernel_call(group, values)
        call()
        median, produced = _median_seconds(call, repeats)
        seconds.append(median)
        values.update(produced)
    return seconds


def time_step(executor, feed: Mapping[str, np.ndarray], repeats: int = 5) -> float:
    """Median seconds of one whole run of ``executor`` on ``feed`` (after one warm-up run)."""
    executor.run(feed)
    return _median_seconds(lambda: executor.run(feed), repeats)[0]


def _median_seconds(run: Callable[[], object], repeats: int) -> tuple[float, object]:
    """The median seconds of ``repeats`` calls of ``run`` (at least one), and what the last returned."""
    times, result = [], None
    for _ in range(max(1, repeats)):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def fusion_report(
    model: CompiledModel, training: bool = False, repeats: int = 5, seed: int = 0, whole_step: bool = True
) -> PolicyReport:
    """Plan, predict and measure ``model``'s inference (or training step) under
    the policy it was compiled with (``whole_step``: the step's median too; a comparison times
    the steps of its policies itself, taking turns, ``compare_steps``)."""
    executor, feed = model.executor_and_feed(model.example_batch(training, seed), training)
    plan = executor.fusion_plan
    costs = executor.cost_model
    graph = executor.planned_graph
    predicting = hasattr(executor, "model_seconds")  # a model target: its clock, not numpy's
    if predicting:
        measured = [executor.model_seconds(group) for group in executor.kernel_groups]
    else:
        measured = time_kernels(executor, feed, repeats)
    rows = []
    for kernel, seconds in zip(plan.kernels, measured, strict=True):
        cost = costs.kernel_cost(graph, kernel)
        rows.append(
            KernelRow(
                kernel.name,
                kernel.ops,
                kernel.materialized,
                kernel.inlined,
                cost.flops,
                cost.bytes,
                cost.seconds,
                seconds,
                kernel.buffered,
            )
        )
    step = float("nan")
    if predicting:
        step = sum(measured)
    elif whole_step:
        step = time_step(executor, feed, repeats)
    step_name = "training step" if training else "inference"
    return PolicyReport(plan.policy, step_name, tuple(rows), step, model.target, dict(plan.notes))


#: a block of steps lasts at least this long (a sub-millisecond step timed alone is timer noise)
BLOCK_SECONDS = 0.02
MAX_BLOCK = 200


@dataclass(frozen=True)
class StepComparison:
    """Policies' steps measured against each other: per policy its ``Timed`` median and interval,
    per policy after the first its ``Versus`` the first, and how: ``rounds`` of ``block`` steps
    each (0 rounds: a model target's predicted times, exact), on ``machine``."""

    timed: Mapping[str, Timed]
    versus: Mapping[str, Versus]
    rounds: int
    block: int
    machine: str


def machine_line(target: str) -> str:
    """The machine a comparison ran on: the CPU, its cores and the threads kernels use; the GPU
    for the cuda target; a model target's own description."""
    from neoflow import targets
    from neoflow.codegen.hardware import cpu_model

    line = f"{cpu_model()}, {os.cpu_count()} cores"
    if target == "cpu":
        from neoflow.targets.cpu.executor import threads

        line += f", {threads()} threads"
    elif target == "cuda":
        from neoflow.targets.cuda import driver

        line = f"{driver.device().name} (host: {line})"
    elif target != "interp":
        line = targets.target(target).description
    return line


def compare_steps(
    models: Mapping[str, CompiledModel],
    training: bool = False,
    rounds: int = 11,
    seconds: float | None = None,
    seed: int = 0,
) -> StepComparison:
    """Each model's step (inference or training) against the first's: measured in ``rounds``
    interleaved rounds (with ``seconds``, until that much time has passed), each a block of
    consecutive steps per model, the order rotating round by round; medians with bootstrap
    intervals, and per model the paired ratio to the first with its verdict (``runtime.timing``;
    ``SAME_PLAN`` where its plan is the first's). A model target's steps are its predicted times:
    compared exactly."""
    names = list(models)
    first = models[names[0]]
    steps, plans = {}, {}
    for name, model in models.items():
        executor, feed = model.executor_and_feed(model.example_batch(training, seed), training)
        plans[name] = executor.fusion_plan
        if hasattr(executor, "model_seconds"):
            steps[name] = sum(executor.model_seconds(group) for group in executor.kernel_groups)
        else:
            steps[name] = lambda executor=executor, feed=feed: executor.run(feed)
    machine = machine_line(first.target)
    if all(isinstance(step, float) for step in steps.values()):
        found = {name: Timed(name, step, step, step) for name, step in steps.items()}
        base = found[names[0]].seconds
        against = {}
        for name in names[1:]:
            ratio = base / found[name].seconds
            exact = "same" if math.isclose(ratio, 1.0, rel_tol=1e-9) else "faster" if ratio > 1 else "slower"
            against[name] = Versus(names[0], name, ratio, ratio, ratio, exact)
        return StepComparison(found, against, 0, 0, machine)
    for step in steps.values():
        step()  # once untimed: threads started, pages touched
    start = time.perf_counter()
    for step in steps.values():
        step()
    each = (time.perf_counter() - start) / len(steps)
    block = max(1, min(MAX_BLOCK, math.ceil(BLOCK_SECONDS / max(each, 1e-9))))
    # warmed up by the two calls above; every block also starts with an untimed call
    times = interleaved_rounds(steps, rounds, warmup=0, block=block, seconds=seconds, rotate=True)
    against = {name: versus(times, names[0], name) for name in names[1:]}
    for name in names[1:]:
        if same_plan(plans[names[0]], plans[name]):
            against[name] = dataclasses.replace(against[name], verdict=SAME_PLAN)
    return StepComparison(timed(times), against, len(times[names[0]]), block, machine)


#: the verdict of a policy whose plan is the first's, kernel for kernel: whatever its measured ratio,
#: the difference is the machine's (noise, where its buffers landed), not the plan's
SAME_PLAN = "same plan"


def same_plan(first: FusionPlan, other: FusionPlan) -> bool:
    """Whether two plans compile to the same kernels: the same ops, stored, buffered and sliced alike,
    in the same order, with the same remarks (tile sizes) per kernel; the policies' names may differ."""
    return first.kernels == other.kernels and dict(first.notes) == dict(other.notes)


def labels(policies: Sequence[str]) -> list[str]:
    """A key per policy for ``compare_steps``: its name, and ``name #k`` where it comes again (a
    policy against itself: what the noise looks like)."""
    found: list[str] = []
    for policy in policies:
        found.append(policy if policy not in found else f"{policy} #{len(found) + 1}")
    return found


def with_step_times(reports: Sequence[PolicyReport], comparison: StepComparison) -> list[PolicyReport]:
    """``reports`` (in the comparison's order) with the comparison's median step times."""
    return [
        dataclasses.replace(report, step_seconds=found.seconds)
        for report, found in zip(reports, comparison.timed.values(), strict=True)
    ]


# ----------------------------------------------------------------- rendering


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of two equally long samples (ties get their mean rank)."""

    def ranks(values: Sequence[float]) -> np.ndarray:
        array = np.asarray(values, dtype=float)
        order = np.argsort(array, kind="stable")
        result = np.empty(len(array))
        result[order] = np.arange(len(array), dtype=float)
        for value in np.unique(array):
            tied = array == value
            result[tied] = result[tied].mean()
        return result

    if len(x) != len(y) or len(x) < 2:
        raise ValueError("spearman needs two samples of the same length, at least 2")
    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])


def _names(names: Sequence[str], limit: int = 4) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" +{len(names) - limit}" if len(names) > limit else "") if names else "-"


def _megabytes(value: float) -> str:
    return f"{value / 1e6:.2f}"


def _milliseconds(value: float) -> str:
    return f"{value * 1e3:.3f}"


KERNEL_COLUMNS = (
    "#",
    "kernel",
    "ops",
    "materialised",
    "recomputed",
    "tile buffer",
    "MFLOP",
    "MB",
    "predicted ms",
    "measured ms",
)


def kernel_table(report: PolicyReport) -> list[list[str]]:
    """The rows of the per-kernel table (``KERNEL_COLUMNS``), a total last."""
    rows = [
        [
            str(k),
            row.name,
            _names(row.ops),
            _names(row.materialized),
            _names(row.recomputed),
            _names(row.buffered),
            f"{row.flops / 1e6:.2f}",
            _megabytes(row.bytes),
            _milliseconds(row.predicted),
            _milliseconds(row.measured),
        ]
        for k, row in enumerate(report.rows)
    ]
    total_measured = sum(r.measured for r in report.rows)
    rows.append(
        [
            "",
            "total",
            str(sum(len(r.ops) for r in report.rows)),
            "",
            "",
            "",
            f"{report.flops / 1e6:.2f}",
            _megabytes(report.bytes),
            _milliseconds(report.predicted),
            _milliseconds(total_measured),
        ]
    )
    return rows


def compare_table(reports: Sequence[PolicyReport], comparison: StepComparison | None = None) -> list[list[str]]:
    """One row per policy (``compare_columns``): kernels, bytes, predicted and measured step time
    (with the comparison's interval), the first policy's step time over this one's (above 1:
    faster) with its interval and verdict; with ``optimal`` among the policies, each one's
    predicted time over the optimum's."""
    optimum = next((r.predicted for r in reports if r.policy == "optimal"), None)
    rows = []
    for k, r in enumerate(reports):
        row = [r.policy, str(len(r.rows)), _megabytes(r.bytes), _milliseconds(r.predicted)]
        if optimum is not None:
            row.append(f"{r.predicted / optimum:.3f}x")
        row.append(_milliseconds(r.step_seconds))
        if comparison is None:
            row.append(f"{reports[0].step_seconds / r.step_seconds:.2f}x")
            rows.append(row)
            continue
        found = list(comparison.timed.values())[k]
        row.append(f"{_milliseconds(found.low)}-{_milliseconds(found.high)}" if comparison.rounds else "exact")
        against = comparison.versus.get(list(comparison.timed)[k])
        if against is None:
            row += ["1.00x", "", "baseline"]
        else:
            interval = f"{against.low:.2f}-{against.high:.2f}" if comparison.rounds else "exact"
            row += [f"{against.ratio:.2f}x", interval, against.verdict]
        rows.append(row)
    return rows


def compare_columns(reports: Sequence[PolicyReport], comparison: StepComparison | None = None) -> list[str]:
    """The columns of ``compare_table`` for these reports."""
    columns = ["policy", "kernels", "MB moved", "predicted ms"]
    if any(r.policy == "optimal" for r in reports):
        columns.append("predicted / optimal")
    columns.append("step ms (median)")
    if comparison is None:
        return [*columns, "vs first"]
    return [*columns, "95 % interval", "vs first", "its 95 % interval", "verdict"]


def markdown(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def plot_comparison(
    reports: Sequence[PolicyReport], path: str | Path, title: str, comparison: StepComparison | None = None
) -> Path:
    """Bar charts of kernels, bytes moved and measured step time per policy (a PNG); with the
    ``comparison`` the step times carry their 95 % intervals as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in reports]
    panels: list[tuple[str, Callable[[PolicyReport], float]]] = [
        ("kernels", lambda r: len(r.rows)),
        ("MB moved (predicted)", lambda r: r.bytes / 1e6),
        ("step time, ms (measured median)", lambda r: r.step_seconds * 1e3),
    ]
    figure, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for axis, (label, value) in zip(axes, panels, strict=True):
        heights = [value(r) for r in reports]
        errors = None
        if label.startswith("step time") and comparison is not None and comparison.rounds:
            found = list(comparison.timed.values())
            errors = [[(t.seconds - t.low) * 1e3 for t in found], [(t.high - t.seconds) * 1e3 for t in found]]
            errors = np.clip(errors, 0, None)
        bars = axis.bar(names, heights, yerr=errors, capsize=3, color=[f"C{k}" for k in range(len(names))])
        axis.bar_label(bars, fmt="%.3g", fontsize=8)
        axis.set_title(label, fontsize=10)
        axis.tick_params(axis="x", rotation=30, labelsize=8)
    return save_figure(figure, title, path)


def save_figure(figure, title: str, path: str | Path) -> Path:
    """Title, lay out and write a matplotlib ``figure`` as a PNG at ``path``, then close it."""
    import matplotlib.pyplot as plt

    figure.suptitle(title, fontsize=11)
    figure.tight_layout()
    out = Path(path)
    figure.savefig(out, dpi=110)
    plt.close(figure)
    return out
