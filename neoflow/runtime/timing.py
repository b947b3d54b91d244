"""Timing that can tell a real difference from noise: systems measured in interleaved rounds of
blocks of calls, medians with bootstrap confidence intervals, and a verdict per pair (what
``neoflow fuse --compare`` and the benchmarks use)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: seconds each block waits before it starts, untimed, then one untimed call of its system: the
#: worker threads of the system that ran before spin for a while after their last call (ONNX Runtime's
#: pool, OpenMP's), and on a small machine they take the cores from the next system's first calls
#: (squeezenet inference here: neoflow 14.3 ms a call right after ONNX Runtime's block, 6.9 ms after
#: the pause); the untimed call wakes the block's own threads, asleep after the pause (alone, the
#: pause made a 0.4 ms step take 10 ms)
SETTLE_SECONDS = 0.05


def interleaved_rounds(
    systems: Mapping[str, Callable[[], object]],
    runs: int,
    warmup: int = 2,
    block: int = 1,
    seconds: float | None = None,
    rotate: bool = False,
) -> dict[str, list[list[float]]]:
    """Wall times of each of ``systems`` round by round: ``runs`` rounds after ``warmup``
    untimed ones (with ``seconds``, rounds until that much time has passed, at least ``runs``),
    each round running every system ``block`` times in a row (each call timed), in turn, so that
    a slow spell of a shared machine falls on all of them alike rather than on whichever ran
    then; each block after ``SETTLE_SECONDS`` of quiet and one untimed call.  ``rotate``: round
    k starts with the k-th system, so none always runs first or after the same other.  A block
    of several calls is what a training loop does (step after step of one model); one call a
    round measures every call just after the other systems have had the caches."""
    for _ in range(warmup):
        for fn in systems.values():
            fn()
    names = list(systems)
    times: dict[str, list[list[float]]] = {name: [] for name in systems}
    started = time.perf_counter()
    done = 0
    while done < runs or (seconds is not None and time.perf_counter() - started < seconds):
        order = names[done % len(names) :] + names[: done % len(names)] if rotate else names
        for name in order:
            fn = systems[name]
            time.sleep(SETTLE_SECONDS)
            fn()
            calls = []
            for _ in range(block):
                start = time.perf_counter()
                fn()
                calls.append(time.perf_counter() - start)
            times[name].append(calls)
        done += 1
    return times


def interleaved_medians(
    systems: Mapping[str, Callable[[], object]], runs: int, warmup: int = 2, block: int = 1
) -> dict[str, float]:
    """Median wall time of each of ``systems`` over every call of ``interleaved_rounds``."""
    return pooled_medians(interleaved_rounds(systems, runs, warmup, block))


def pooled_medians(rounds: Mapping[str, list[list[float]]]) -> dict[str, float]:
    """Each system's median call over all the rounds of ``interleaved_rounds``."""
    return {name: statistics.median(t for calls in values for t in calls) for name, values in rounds.items()}


def round_ratios(rounds: Mapping[str, list[list[float]]], base: str, other: str) -> list[float]:
    """Per round of ``interleaved_rounds``: the median call of ``base`` over that of
    ``other`` (how many times faster ``other`` ran in that round)."""
    return [statistics.median(b) / statistics.median(o) for b, o in zip(rounds[base], rounds[other], strict=True)]


# ------------------------------------------------------------------ confidence


#: the confidence of the intervals, and the resamples of the bootstrap that finds them
CONFIDENCE = 0.95
RESAMPLES = 4000
#: a difference smaller than this share is called ``within noise`` even where the interval
#: excludes none: a plan 1 % faster on this machine today is not one a researcher can rely on
MARGIN = 0.02


def bootstrap_interval(values: Sequence[float], seed: int = 0) -> tuple[float, float]:
    """The ``CONFIDENCE`` percentile-bootstrap interval of the median of ``values`` (resampled
    ``RESAMPLES`` times with a fixed seed: the same values give the same interval)."""
    data = np.asarray(values, dtype=float)
    if data.size < 2:
        value = float(data[0]) if data.size else float("nan")
        return value, value
    picks = np.random.default_rng(seed).integers(0, data.size, size=(RESAMPLES, data.size))
    medians = np.median(data[picks], axis=1)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(medians, [tail, 1 - tail])
    return float(low), float(high)


@dataclass(frozen=True)
class Timed:
    """A system's median ``seconds`` a call over every round's block, and the interval
    (``low``, ``high``) of the median of its rounds' block medians."""

    name: str
    seconds: float
    low: float
    high: float


@dataclass(frozen=True)
class Versus:
    """``other`` against ``base``: ``ratio`` is the median over rounds of base's block median over
    other's in the same round (above 1: other is faster), with its interval and a ``verdict``:
    ``faster``/``slower`` where the interval excludes 1 and the ratio is off 1 by ``MARGIN`` or
    more, else ``within noise``."""

    base: str
    other: str
    ratio: float
    low: float
    high: float
    verdict: str


def timed(rounds: Mapping[str, list[list[float]]]) -> dict[str, Timed]:
    """Each system's ``Timed`` from ``interleaved_rounds``' times."""
    result = {}
    for name, blocks in rounds.items():
        medians = [statistics.median(calls) for calls in blocks]
        low, high = bootstrap_interval(medians)
        result[name] = Timed(name, statistics.median(t for calls in blocks for t in calls), low, high)
    return result


def versus(rounds: Mapping[str, list[list[float]]], base: str, other: str) -> Versus:
    """``other`` against ``base`` from ``interleaved_rounds``' times (paired by round, so a slow
    spell of the machine that hits both in one round cancels)."""
    ratios = round_ratios(rounds, base, other)
    ratio = statistics.median(ratios)
    low, high = bootstrap_interval(ratios)
    return Versus(base, other, ratio, low, high, verdict(ratio, low, high))


def verdict(ratio: float, low: float, high: float) -> str:
    """``faster``, ``slower`` or ``within noise`` for a speed ratio (above 1: faster) and its interval."""
    if low > 1 and ratio >= 1 + MARGIN:
        return "faster"
    if high < 1 and ratio <= 1 / (1 + MARGIN):
        return "slower"
    return "within noise"
