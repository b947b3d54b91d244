"""Timing: systems take turns in rounds of blocks, medians per system, bootstrap intervals and
verdicts that call identical systems within noise and a real difference faster or slower."""

from __future__ import annotations

import time

import numpy as np
import pytest

from neoflow.runtime import timing
from neoflow.runtime.timing import (
    bootstrap_interval,
    interleaved_medians,
    interleaved_rounds,
    pooled_medians,
    round_ratios,
    timed,
    verdict,
    versus,
)


def test_systems_take_turns_run_by_run_after_the_warm_up() -> None:
    calls: list[str] = []
    systems = {name: (lambda name=name: calls.append(name)) for name in ("ours", "peer")}
    medians = interleaved_medians(systems, runs=3, warmup=1)
    assert calls == ["ours", "peer"] * 1 + ["ours", "ours", "peer", "peer"] * 3  # each block after an untimed call
    assert set(medians) == {"ours", "peer"} and all(t >= 0 for t in medians.values())


def test_one_system_is_timed_alone() -> None:
    calls: list[int] = []
    assert interleaved_medians({"only": lambda: calls.append(1)}, runs=5, warmup=2)["only"] >= 0
    assert len(calls) == 12  # 2 warm-up calls, then 5 blocks of an untimed and a timed call


def test_rounds_keep_each_block_and_ratios_compare_round_by_round() -> None:
    systems = {"slow": lambda: None, "fast": lambda: None}
    rounds = interleaved_rounds(systems, runs=4, warmup=0, block=3)
    assert [len(calls) for calls in rounds["slow"]] == [3] * 4 and len(rounds["fast"]) == 4
    fake = {"slow": [[4.0, 6.0, 5.0], [9.0, 8.0, 10.0]], "fast": [[2.0, 2.5, 3.0], [4.0, 5.0, 6.0]]}
    assert round_ratios(fake, "slow", "fast") == [2.0, 1.8]
    assert pooled_medians(fake) == {"slow": 7.0, "fast": 3.5}  # over every call of every round


def test_each_block_starts_after_a_quiet_pause_and_a_call_that_are_not_timed(monkeypatch) -> None:
    events: list[object] = []
    monkeypatch.setattr(timing.time, "sleep", lambda seconds: events.append(seconds))
    systems = {name: (lambda name=name: events.append(name)) for name in ("ours", "peer")}
    rounds = interleaved_rounds(systems, runs=2, warmup=0, block=2)
    pause = timing.SETTLE_SECONDS
    assert pause > 0 and events == [pause, "ours", "ours", "ours", pause, "peer", "peer", "peer"] * 2
    assert all(t < pause for calls in rounds.values() for block in calls for t in block)


def test_rotated_rounds_start_with_each_system_in_turn() -> None:
    calls: list[str] = []
    systems = {name: (lambda name=name: calls.append(name)) for name in ("a", "b", "c")}
    interleaved_rounds(systems, runs=3, warmup=0, block=1, rotate=True)
    firsts = [calls[k] for k in range(0, len(calls), 6)]  # each block: an untimed and a timed call
    assert firsts == ["a", "b", "c"]


def test_a_time_budget_runs_rounds_until_it_is_spent() -> None:
    systems = {"a": lambda: time.sleep(0.002), "b": lambda: None}
    rounds = interleaved_rounds(systems, runs=2, warmup=0, seconds=0.5)
    assert len(rounds["a"]) > 2 and len(rounds["a"]) == len(rounds["b"])


def test_a_bootstrap_interval_holds_the_median_and_is_repeatable() -> None:
    values = [1.0, 1.1, 0.9, 1.05, 0.95, 1.02, 0.98, 1.3, 0.7]
    low, high = bootstrap_interval(values)
    assert low <= 1.0 <= high and (low, high) == bootstrap_interval(values)
    assert bootstrap_interval([2.0]) == (2.0, 2.0)


@pytest.mark.parametrize(
    ("ratio", "low", "high", "expected"),
    [
        (1.5, 1.3, 1.7, "faster"),
        (0.6, 0.5, 0.7, "slower"),
        (1.1, 0.95, 1.2, "within noise"),  # the interval holds 1
        (1.01, 1.005, 1.015, "within noise"),  # real, perhaps, but smaller than the margin
    ],
)
def test_verdicts(ratio: float, low: float, high: float, expected: str) -> None:
    assert verdict(ratio, low, high) == expected


def test_identical_systems_come_out_within_noise_and_a_slower_one_slower() -> None:
    # rounds as interleaved_rounds gives them (15 rounds of 5 calls), drawn with a fixed seed: the same
    # 3 % call-to-call noise and round-to-round drift (a slow spell hits every system of a round) for all,
    # one system twice as slow; measured times would make the verdict a property of this machine's load
    rng = np.random.default_rng(7)
    drift = 1 + 0.05 * rng.random(15)
    means = {"base": 1e-3, "same": 1e-3, "double": 2e-3}
    rounds = {
        name: [list(mean * drift[r] * (1 + 0.03 * rng.standard_normal(5))) for r in range(15)]
        for name, mean in means.items()
    }
    assert versus(rounds, "base", "same").verdict == "within noise"
    assert versus(rounds, "base", "double").verdict == "slower"
    found = timed(rounds)
    assert found["base"].low <= found["base"].high and found["double"].seconds > found["base"].seconds
