"""``neoflow tune``: a compiled model's kernels measured on this machine, the results kept for every
later compile, and the step timed before and after.

On the cpu target (``targets.cpu.tuning``) the kernels are tuned on the values a real step gives them
(the example batch run kernel by kernel); on the cuda target (``targets.cuda.tuner``) each tensor-core
piece on random inputs.  The costliest first (by their arithmetic), until the time budget is spent.
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
from neoflow.ir.op import Op, positional_variables
from neoflow.runtime.compiled import CompiledModel
from neoflow.targets.cache import within_budget
from neoflow.targets.cpu.executor import threads
from neoflow.targets.cpu.lower import lower_op, lowering_paths
from neoflow.targets.cpu.tuning import compare, describe, kernel_key, load_table, record, table_path, tune_op


@dataclass(frozen=True)
class TuneRow:
    """One kernel tuned: its name, the choice kept, the default's and the kept choice's median
    seconds, the candidates timed and those not used (their output differed from the default's, or
    they spill registers)."""

    kernel: str
    choice: str
    default_seconds: float
    seconds: float
    candidates: int
    rejected: tuple[str, ...] = ()

    @property
    def speedup(self) -> float:
        return self.default_seconds / self.seconds if self.seconds > 0 else 1.0


@dataclass(frozen=True)
class TuneReport:
    """What ``tune_model`` did: a row per kernel it measured, the kernels it had no time for, those
    it skipped as tuned already, and where the table is."""

    rows: tuple[TuneRow, ...]
    left: int
    known: int
    table: Path


def tunable(executor) -> list[tuple[Op, str]]:
    """The ops of a cpu ``executor`` running as kernels of their own with more than one way to lower
    them, each with its default C, one per kernel (ops compiling to the same code share it), the most
    arithmetic first."""
    found: dict[str, tuple[Op, str]] = {}
    for op in executor.own_kernels():
        if len(lowering_paths(op)) < 2:
            continue
        op = positional_variables(op)  # as the executor lowers it (``cpu.executor.module_source``)
        code = lower_op(op, "KERNEL")
        found.setdefault(kernel_key(code), (op, code))
    return sorted(found.values(), key=lambda pair: -op_work(pair[0]).flops)


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
    total, kernel)`` is told before each kernel."""
    if not 0 < budget_seconds < float("inf"):
        raise InputError(f"the tuning budget must be a positive number of seconds, got {budget_seconds}")
    check_can_tune(model.target)
    if model.target == "cuda":
        return _tune_cuda(model, training, budget_seconds, retune, progress)
    deadline = time.perf_counter() + budget_seconds
    executor, feed = model.executor_and_feed(model.example_batch(training, seed), training)
    kernels = tunable(executor)
    known = load_table(threads())
    todo = [(op, code) for op, code in kernels if retune or kernel_key(code) not in known]
    codes = {op.name: code for op, code in todo}
    values = _all_values(executor, feed)
    rows: list[TuneRow] = []
    for op in within_budget([op for op, _ in todo], deadline, progress):
        result = tune_op(op, [values[t.name] for t in op.inputs], deadline, codes[op.name])
        record([result], threads())  # kept as found: an interrupted run loses nothing measured
        rows.append(
            TuneRow(
                op.name, describe(result.choice), result.default_seconds, result.seconds, result.tried, result.rejected
            )
        )
    if progress is not None:
        progress(len(rows), len(todo), "")
    return TuneReport(tuple(rows), len(todo) - len(rows), len(kernels) - len(todo), table_path(threads()))


def check_can_tune(target: str) -> None:
    """A one-line error where ``target``'s kernels cannot be measured here (another target; no GPU for
    ``cuda``), before any work."""
    if target not in ("cpu", "cuda"):
        raise InputError(f"neoflow tune measures the cpu and cuda targets' kernels, not '{target}'s")
    if target == "cuda":
        from neoflow.targets.cuda.driver import device

        device()


def _tune_cuda(model, training: bool, budget_seconds: float, retune: bool, progress) -> TuneReport:
    """``tune_model`` on the cuda target: every tensor-core piece of the step's ops timed on the GPU."""
    from neoflow.targets.cuda import tuner
    from neoflow.targets.cuda.tuning import table_path as cuda_table

    executor, feed = model.executor_and_feed(model.example_batch(training), training)
    arch, precision = executor.arch, executor.precision
    ops = tuner.tensor_core_ops(executor.graph, precision, arch)
    skipped = [op for op in ops if not retune and tuner.tuned_pieces(op, precision, arch)]
    todo = [op for op in ops if op not in skipped]
    results = tuner.tune_graph(executor, feed, todo, budget_seconds, progress)
    rows = []
    for r in results:
        kept = tuner.describe(r.fastest)
        choice = f"{kept} (the model's)" if r.fastest == r.chosen else f"{kept}, not {tuner.describe(r.chosen)}"
        rows.append(
            TuneRow(f"{r.op} piece {r.piece}", choice, r.chosen_seconds, r.fastest_seconds, r.tried, r.rejected)
        )
    done = len({r.op for r in results})
    return TuneReport(tuple(rows), len(todo) - done, len(skipped), cuda_table(arch))


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
    of consecutive steps taking turns (on the cuda target: replays of the step's CUDA graph, its
    inputs already on the GPU, so that the copies to and from the host do not hide the kernels)."""
    batch = before.example_batch(training, seed)
    if before.target == "cuda":
        from neoflow.targets.cuda.tuner import time_in_turns

        graphs = []
        for model in (before, after):
            executor, feed = model.executor_and_feed(batch, training)
            executor.run(feed)
            graphs.append(executor.replay_graph)
        untuned, tuned = time_in_turns(graphs, rounds=10)
        return untuned, tuned
    if training:
        return compare(lambda: before.train_step(batch), lambda: after.train_step(batch), rounds=5)
    return compare(lambda: before.run(batch), lambda: after.run(batch), rounds=5)
