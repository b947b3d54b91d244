"""Timing helper shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping

#: seconds each block waits before it starts, untimed, then one untimed call of its system: the
#: worker threads of the system that ran before spin for a while after their last call (ONNX Runtime's
#: pool, OpenMP's), and on a small machine they take the cores from the next system's first calls
#: (squeezenet inference here: neoflow 14.3 ms a call right after ONNX Runtime's block, 6.9 ms after
#: the pause); the untimed call wakes the block's own threads, asleep after the pause (alone, the
#: pause made a 0.4 ms step take 10 ms)
SETTLE_SECONDS = 0.05


def interleaved_rounds(
    systems: Mapping[str, Callable[[], object]], runs: int, warmup: int = 2, block: int = 1
) -> dict[str, list[list[float]]]:
    """Wall times of each of ``systems`` round by round: ``runs`` rounds after ``warmup``
    untimed ones, each round running every system ``block`` times in a row (each call
    timed), in turn, so that a slow spell of a shared machine falls on all of them alike
    rather than on whichever ran then; each block after ``SETTLE_SECONDS`` of quiet and one untimed
    call.  A block
    of several calls is what a training loop does (step after step of one model); one call a
    round measures every call just after the other systems have had the caches."""
    for _ in range(warmup):
        for fn in systems.values():
            fn()
    times: dict[str, list[list[float]]] = {name: [] for name in systems}
    for _ in range(runs):
        for name, fn in systems.items():
            time.sleep(SETTLE_SECONDS)
            fn()
            calls = []
            for _ in range(block):
                start = time.perf_counter()
                fn()
                calls.append(time.perf_counter() - start)
            times[name].append(calls)
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
