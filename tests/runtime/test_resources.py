"""Resource guards: memory past the machine's and work past the time limit fail at once, naming the tensor
or op; the limit is the user's to raise or lift."""

from __future__ import annotations

import time

import numpy as np
import pytest

import neoflow
from neoflow.errors import InputError, ResourceError
from neoflow.runtime import resources
from tests.on_targets import NEEDS_CC

# a reduction over 10^15 points: hours on any machine
CUBE = "Y[a] = ReduceAdd({i, j, k}, X[i] * X[j] * X[k])"


def _cube(size: int):
    return neoflow.op(CUBE, shapes={"X": (size,)}, out_shape=(1,))


@pytest.mark.parametrize("call", ["evaluate", "interp", "cpu", "grad"])
def test_work_past_the_time_limit_stops_at_once_naming_the_op(call) -> None:
    op = _cube(100_000)
    start = time.perf_counter()
    with pytest.raises(ResourceError, match=r"op 'Y' alone does 3e\+15 operations .* time limit of 600 s") as caught:
        if call == "evaluate":
            neoflow.evaluate(op, {"X": np.ones(100_000, np.float32)})
        else:
            neoflow.compile(op, target="interp" if call == "grad" else call, grad=call == "grad")
    assert "\n" not in str(caught.value) and time.perf_counter() - start < 5.0


def test_the_time_limit_is_the_users(monkeypatch) -> None:
    small = _cube(30)
    monkeypatch.setenv("NEOFLOW_TIME_LIMIT", "1e-9")
    with pytest.raises(ResourceError, match="time limit of 0 s"):
        neoflow.compile(small, target="interp")
    monkeypatch.setenv("NEOFLOW_TIME_LIMIT", "0")  # lifted
    assert neoflow.compile(small, target="interp").run({"X": np.ones(30)})[0] == pytest.approx(27_000)
    monkeypatch.setenv("NEOFLOW_TIME_LIMIT", "soon")
    with pytest.raises(InputError, match="NEOFLOW_TIME_LIMIT must be a number of seconds, got 'soon'"):
        neoflow.compile(small, target="interp")


def test_this_machines_measured_peak_bounds_large_work() -> None:
    graph = neoflow.Graph.from_ops([_cube(20_000)])  # 2.4e13 operations: 40 minutes at 1e10 per second
    asked = []

    def peak(value):
        return lambda: asked.append(value) or value

    resources.check_work(graph, "cpu", measured_peak=peak(1e12))  # 24 s at that peak
    with pytest.raises(ResourceError, match="at least 400 minutes on target cpu"):
        resources.check_work(graph, "cpu", measured_peak=peak(1e9))
    resources.check_work(neoflow.Graph.from_ops([_cube(100)]), "cpu", measured_peak=peak(1.0))
    assert asked == [1e12, 1e9]  # small work never measures the machine


def test_a_tensor_past_the_machines_memory_stops_before_allocating() -> None:
    op = neoflow.op("Y[i, j] = X[i] * X[j]", shapes={"X": (1_000_000,)})
    for target in ("interp", "evaluate"):
        with pytest.raises(ResourceError, match=r"tensor 'Y' \(\[1000000, 1000000\] float32\) needs 3725.3 GiB"):
            if target == "evaluate":
                neoflow.evaluate(op, {"X": np.ones(1_000_000, np.float32)})
            else:
                neoflow.compile(op, target=target)


@NEEDS_CC
def test_a_large_but_feasible_reduction_runs() -> None:
    op = _cube(200)  # 8e6 points
    assert neoflow.compile(op, target="cpu").run({"X": np.ones(200, np.float32)})[0] == pytest.approx(8e6)
