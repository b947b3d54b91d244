"""The benchmarks' timing helper: systems take turns, medians per system."""

from __future__ import annotations

from benchmarks.timing import interleaved_medians, interleaved_rounds, pooled_medians, round_ratios


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


def test_the_gpu_operator_suite_matches_pytorch_on_the_cpu() -> None:
    import numpy as np
    import torch

    import neoflow
    from benchmarks.gpu_ops import operators

    cheap = {"gemv", "bilinear", "conv1d", "conv1d_transposed"}
    for operator in operators():
        op = neoflow.op(operator.text, shapes=operator.shapes, out_shape=operator.out_shape)
        rng = np.random.default_rng(0)
        arrays = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in operator.shapes.items()}
        with torch.no_grad():
            theirs = operator.torch({name: torch.from_numpy(a) for name, a in arrays.items()}).numpy()
        assert op.shape == theirs.shape, operator.name
        if operator.name in cheap:  # the same values (the convolutions' sizes are for a GPU)
            ours = neoflow.evaluate(op, arrays)
            assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max(), operator.name


def test_each_block_starts_after_a_quiet_pause_and_a_call_that_are_not_timed(monkeypatch) -> None:
    import benchmarks.timing as timing

    events: list[object] = []
    monkeypatch.setattr(timing.time, "sleep", lambda seconds: events.append(seconds))
    systems = {name: (lambda name=name: events.append(name)) for name in ("ours", "peer")}
    rounds = interleaved_rounds(systems, runs=2, warmup=0, block=2)
    pause = timing.SETTLE_SECONDS
    assert pause > 0 and events == [pause, "ours", "ours", "ours", pause, "peer", "peer", "peer"] * 2
    assert all(t < pause for calls in rounds.values() for block in calls for t in block)
