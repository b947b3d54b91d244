"""Timing helper shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def interleaved_medians(
    systems: Mapping[str, Callable[[], object]], runs: int, warmup: int = 2, block: int = 1
) -> dict[str, float]:
    """Median wall time of each of ``systems`` over ``runs`` rounds, after ``warmup``
    untimed rounds; each round runs every system ``block`` times in a row (each call
    timed), in turn, so that a slow spell of a shared machine falls on all of them alike
    rather than on whichever ran then.  A block of several calls is what a training
    loop does (step after step of one model); one call a round measures every call
    just after the other systems have had the caches."""
    for _ in range(warmup):
        for fn in systems.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in systems}
    for _ in range(runs):
        for name, fn in systems.items():
            for _ in range(block):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}
