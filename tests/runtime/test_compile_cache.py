"""The compile cache: the same model, options and neoflow load the compiled model instead of compiling."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.runtime import compile_cache
from tests.on_targets import NEEDS_CC

CNN = Path(__file__).resolve().parents[2] / "models" / "cnn.onnx"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("NEOFLOW_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("NEOFLOW_COMPILE_CACHE", "1")
    return tmp_path


@NEEDS_CC
def test_a_second_compile_loads_the_first_and_trains_alike(cache) -> None:
    spec = neoflow.TrainSpec(labels="y", optimizer="momentum", lr=0.05)
    first = neoflow.compile(CNN, target="cpu", train=spec)
    second = neoflow.compile(CNN, target="cpu", train=spec)
    assert not first.from_cache and second.from_cache
    assert len(list((cache / "models").glob("*.pickle"))) == 1
    batch = first.example_batch(training=True)
    losses = [first.train_step(batch) for _ in range(3)]
    assert [second.train_step(batch) for _ in range(3)] == losses
    x = {"x": batch["x"]}
    np.testing.assert_array_equal(first.run(x)["logits"], second.run(x)["logits"])
    # the kernel cache emptied, a loaded model builds its library again from the source it keeps
    shutil.rmtree(cache / "kernels")
    third = neoflow.compile(CNN, target="cpu", train=spec)
    assert third.from_cache and [third.train_step(batch) for _ in range(3)] == losses
    assert list((cache / "kernels").glob("*.so"))


def test_another_option_model_or_neoflow_is_another_entry(cache, tmp_path, monkeypatch) -> None:
    neoflow.compile(CNN, target="interp", train=neoflow.TrainSpec(labels="y", lr=0.1))
    assert not neoflow.compile(CNN, target="interp", train=neoflow.TrainSpec(labels="y", lr=0.2)).from_cache
    assert not neoflow.compile(CNN, target="interp").from_cache
    assert neoflow.compile(CNN, target="interp").from_cache
    copy = tmp_path / "copy.onnx"
    copy.write_bytes(CNN.read_bytes())
    assert neoflow.compile(copy, target="interp").from_cache  # the same bytes under another name
    monkeypatch.setattr(compile_cache, "code_hash", lambda: "another neoflow")
    assert not neoflow.compile(CNN, target="interp").from_cache
    monkeypatch.setenv("NEOFLOW_COMPILE_CACHE", "0")
    assert not neoflow.compile(CNN, target="interp").from_cache


def test_only_targets_whose_executors_reload_are_cached(cache) -> None:
    from neoflow.frontend import read_model
    from neoflow.runtime.compiled import _cache_key

    proto = read_model(CNN)  # what compile hands the key, read once
    assert _cache_key(proto, "interp", None, None, None, "neoflow", None) is not None
    assert _cache_key(proto, "cuda", None, None, None, "neoflow", None) is None  # NVRTC paths, a GPU context
    assert _cache_key(proto, "interp", None, None, {"c1": np.zeros(1)}, "neoflow", None) is None


def test_an_unreadable_entry_is_compiled_again(cache) -> None:
    neoflow.compile(CNN, target="interp")
    (entry,) = (cache / "models").glob("*.pickle")
    entry.write_bytes(b"not a pickle")
    assert not neoflow.compile(CNN, target="interp").from_cache


def test_an_entry_whose_bytes_changed_is_compiled_again(cache) -> None:
    neoflow.compile(CNN, target="interp")
    (entry,) = (cache / "models").glob("*.pickle")
    data = bytearray(entry.read_bytes())
    data[-2] ^= 0x01  # a flipped bit that still unpickles would be a silently wrong model
    entry.write_bytes(bytes(data))
    assert not neoflow.compile(CNN, target="interp").from_cache
    assert neoflow.compile(CNN, target="interp").from_cache  # stored whole again
