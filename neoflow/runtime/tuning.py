"""``neoflow tune``: a compiled model's kernels measured on this machine (``targets.cpu.tuning``), the
results kept for every later compile, and the step timed before and after.

The kernels are tuned on the values a real step gives them (the example batch run kernel by kernel),
the costliest first (by their arithmetic), until the time budget is spent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from neoflow.errors import InputError
from neoflow.fusion.work import op_work
from neoflow.ir.op import Op
from neoflow.runtime.compiled import CompiledModel
from neoflow.targets.cpu.executor import threads
from neoflow.targets.cpu.lower import lower_op, lowering_paths
from neoflow.targets.cpu.tuning import TuneResult, compare, kernel_key, load_table, record, table_path, tune_op


@dataclass(frozen=True)
class TuneReport:
    """What ``tune_model`` did: the results it measured, the kernels it had no time for, those it
    skipped as tuned already, and where the table is."""

    results: tuple[TuneResult, ...]
    left: int
    known: int
    table: Path


def tunable(executor) -> list[Op]:
    """The ops of a cpu ``executor`` running as kernels of their own with more than one way to lower
    them, one per kernel (ops compiling to the same code share it), the most arithmetic first."""
    found: dict[str, Op] = {}
    for op in executor.own_kernels():
        if len(lowering_paths(op)) < 2:
            continue
        found.setdefault(kernel_key(lower_op(op, "KERNEL")), op)
    return sorted(found.values(), key=lambda op: -op_work(op).flops)


def tune_model(
    model: CompiledModel,
    training: bool,
    budget_seconds: float,
    retune: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
    seed: int = 0,
) -> TuneReport:
    """Tune the kernels of ``model``'s inference (or training step) within ``budget_seconds`` and
    record what was found; ``retune``: measure kernels the table has already; ``progress(done,
    total, op)`` is told before each kernel."""
    if model.target != "cpu":
        raise InputError(f"neoflow tune measures the cpu target's kernels; the model was compiled for '{model.target}'")
    if budget_seconds <= 0:
        raise InputError(f"the tuning budget must be positive, got {budget_seconds} s")
    deadline = time.perf_counter() + budget_seconds
    executor, feed = model.executor_and_feed(model.example_batch(training, seed), training)
    ops = tunable(executor)
    known = load_table(threads())
    todo = [op for op in ops if retune or kernel_key(lower_op(op, "KERNEL")) not in known]
    values = _all_values(executor, feed)
    results: list[TuneResult] = []
    for done, op in enumerate(todo):
        if time.perf_counter() > deadline:
            break
        if progress is not None:
            progress(done, len(todo), op.name)
        results.append(tune_op(op, [values[t.name] for t in op.inputs], deadline))
        record(results[-1:], threads())  # kept as found: an interrupted run loses nothing measured
    if progress is not None:
        progress(len(results), len(todo), "")
    return TuneReport(tuple(results), len(todo) - len(results), len(ops) - len(todo), table_path(threads()))


def _all_values(executor, feed) -> dict:
    """Every tensor of a run of ``executor`` on ``feed``: its kernels run one after another."""
    values = dict(feed)
    for group in executor.kernel_groups:
        values.update(executor.kernel_call(group, values)())
    return values


@contextmanager
def untuned():
    """Compiles inside use no tuning table (``NEOFLOW_TUNING=0``)."""
    before = os.environ.get("NEOFLOW_TUNING")
    os.environ["NEOFLOW_TUNING"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["NEOFLOW_TUNING"]
        else:
            os.environ["NEOFLOW_TUNING"] = before


def compare_steps(before: CompiledModel, after: CompiledModel, training: bool, seed: int = 0) -> tuple[float, float]:
    """Median seconds of a step of ``before`` and of ``after`` on one example batch, timed in blocks
    of consecutive steps taking turns."""
    batch = before.example_batch(training, seed)
    if training:
        return compare(lambda: before.train_step(batch), lambda: after.train_step(batch), rounds=5)
    return compare(lambda: before.run(batch), lambda: after.run(batch), rounds=5)
