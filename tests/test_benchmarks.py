"""The benchmarks' timing helper: systems take turns, medians per system."""

from __future__ import annotations

from benchmarks.timing import interleaved_medians


def test_systems_take_turns_run_by_run_after_the_warm_up() -> None:
    calls: list[str] = []
    systems = {name: (lambda name=name: calls.append(name)) for name in ("ours", "peer")}
    medians = interleaved_medians(systems, runs=3, warmup=1)
    assert calls == ["ours", "peer"] * 4
    assert set(medians) == {"ours", "peer"} and all(t >= 0 for t in medians.values())


def test_one_system_is_timed_alone() -> None:
    calls: list[int] = []
    assert interleaved_medians({"only": lambda: calls.append(1)}, runs=5, warmup=2)["only"] >= 0
    assert len(calls) == 7
