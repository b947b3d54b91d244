"""Build directories: saved atomically (an interrupted save leaves the previous one loadable), read back
verified (a damaged file is named)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.errors import InputError
from neoflow.runtime import build_dir
from neoflow.targets.cache import file_digest

MODELS = Path(__file__).resolve().parents[2] / "models"
SPEC = neoflow.TrainSpec(labels="y", optimizer="adam", lr=1e-2)


def _batch(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((32, 64)).astype(np.float32), "y": rng.integers(0, 10, 32)}


@pytest.fixture(scope="module")
def model():
    return neoflow.compile(MODELS / "mlp.onnx", target="interp", train=SPEC)


def _signature(model) -> tuple[int, float]:
    """What tells saves apart: the step and a parameter sum."""
    return model.step, float(sum(v.sum() for v in model.parameters().values()))


class _Interrupted(Exception):
    """A save stopped at one of its renames."""


def test_a_save_interrupted_at_any_point_leaves_a_whole_save(model, tmp_path, monkeypatch) -> None:
    pristine, build = tmp_path / "previous", tmp_path / "build"
    model.train_step(_batch(0))
    model.save(pristine)
    old = _signature(model)
    model.train_step(_batch(1))
    new = _signature(model)
    real_replace, real_rename = os.replace, os.rename
    for interrupt_at in range(100):
        shutil.rmtree(build, ignore_errors=True)
        shutil.copytree(pristine, build)
        moves: list[str] = []

        def moving(real, moves=moves, interrupt_at=interrupt_at):
            def move(source, destination):
                if len(moves) == interrupt_at:
                    raise _Interrupted
                moves.append(Path(destination).name)
                return real(source, destination)

            return move

        # every rename of the save (files written atomically, the commit point, each file moved into its
        # place) is a point where it can stop
        with monkeypatch.context() as patched:
            patched.setattr(os, "replace", moving(real_replace))
            patched.setattr(os, "rename", moving(real_rename))
            try:
                model.save(build)
                finished = True
            except _Interrupted:
                finished = False
        assert _signature(neoflow.load(build)) == (new if build_dir.PENDING in moves else old), moves
        if finished:
            break
    assert interrupt_at > 6 and moves.index(build_dir.PENDING) < len(moves) - 5  # files moved after the commit
    assert {p.name for p in build.iterdir() if p.name.startswith(".")} == set()
    # a save after an interrupted one completes or clears what that one left
    shutil.copytree(pristine, build, dirs_exist_ok=True)
    (build / build_dir.PENDING).mkdir()
    (build / ".saving-x").mkdir()
    model.save(build)
    assert {p.name for p in build.iterdir() if p.name.startswith(".")} == set()
    assert _signature(neoflow.load(build)) == new


def test_a_killed_saving_process_leaves_a_loadable_save(tmp_path) -> None:
    build = tmp_path / "build"
    saver = """
import sys
from pathlib import Path
import numpy as np
import neoflow
build = Path(sys.argv[2])
if build.exists():  # each process goes on from the last save
    model = neoflow.load(build)
else:
    model = neoflow.compile(Path(sys.argv[1]), target="interp", train=neoflow.TrainSpec(labels="y"))
rng = np.random.default_rng(model.step)
model.save(build)
print("saved", flush=True)
while True:
    model.train_step({"x": rng.standard_normal((32, 64)).astype(np.float32), "y": rng.integers(0, 10, 32)})
    model.save(sys.argv[2])
"""
    rng = np.random.default_rng(1)
    steps = []
    for _ in range(3):
        process = subprocess.Popen(
            [sys.executable, "-c", saver, str(MODELS / "mlp.onnx"), str(build)], stdout=subprocess.PIPE
        )
        assert process.stdout.readline().strip() == b"saved"
        time.sleep(rng.uniform(0.05, 0.6))
        process.send_signal(signal.SIGKILL)
        process.wait()
        process.stdout.close()
        loaded = neoflow.load(build)  # never an error: the last committed save
        steps.append(loaded.step)
        assert all(np.isfinite(v).all() for v in loaded.parameters().values())
    assert steps == sorted(steps) and steps[-1] > 0


def _saved(model, tmp_path) -> Path:
    build = tmp_path / "build"
    model.save(build)
    return build


@pytest.mark.parametrize("damage", ["flipped", "truncated", "missing"])
@pytest.mark.parametrize("file", ["model.onnx", "state.npz", "train_step.nf"])
def test_a_damaged_file_is_named(model, tmp_path, damage, file) -> None:
    path = _saved(model, tmp_path) / file
    data = path.read_bytes()
    if damage == "flipped":
        path.write_bytes(data[:-40] + bytes([data[-40] ^ 0x10]) + data[-39:])
    elif damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    else:
        path.unlink()
    with pytest.raises(InputError) as caught:
        neoflow.load(path.parent)
    message = str(caught.value)
    assert f"'{path}'" in message and "\n" not in message
    assert ("missing" if damage == "missing" else "damaged") in message


def _rewrite(build: Path, name: str, write) -> None:
    """Replace the build's file ``name`` and record it in the manifest, as a hand edit would."""
    write(build / name)
    manifest = json.loads((build / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": (build / name).stat().st_size, "sha256": file_digest(build / name)}
    (build / "manifest.json").write_text(json.dumps(manifest))


def test_saved_state_of_the_wrong_shape_is_named(model, tmp_path) -> None:
    build = _saved(model, tmp_path)
    with np.load(build / "state.npz") as saved:
        state = {k: saved[k] for k in saved.files}
    name = sorted(state)[0]
    state[name] = np.zeros(7, np.float32)
    _rewrite(build, "state.npz", lambda path: np.savez(path, **state))
    with pytest.raises(
        InputError, match=rf"state.npz' does not fit the model: optimizer state '{name}' is of shape \[7\]"
    ):
        neoflow.load(build)


def test_unreadable_saved_arrays_are_an_input_error(tmp_path) -> None:
    graph = neoflow.graph("W = tensor([4])\nX = tensor([4])\nY[i] = X[i] * W[i]")
    text = neoflow.compile(graph, target="interp", parameters={"W": np.ones(4)})
    build = _saved(text, tmp_path)
    _rewrite(build, "parameters.npz", lambda path: path.write_bytes(b"PK\x03\x04 not a zip"))
    with pytest.raises(InputError, match=r"parameters.npz' cannot be read as saved arrays"):
        neoflow.load(build)


def test_a_build_saved_before_files_were_listed_still_loads(model, tmp_path) -> None:
    build = _saved(model, tmp_path)
    manifest = json.loads((build / "manifest.json").read_text())
    del manifest["files"]
    manifest["format"] = "neoflow-build/1"
    (build / "manifest.json").write_text(json.dumps(manifest))
    assert _signature(neoflow.load(build)) == _signature(model)


@pytest.mark.parametrize("manifest", ['{"files": 3}', "[1]", '{"files": {"../x": {}}}', "{"])
def test_a_malformed_manifest_is_an_input_error(tmp_path, manifest) -> None:
    (tmp_path / "manifest.json").write_text(manifest)
    with pytest.raises(InputError, match="is not a valid neoflow manifest"):
        neoflow.load(tmp_path)


def test_shapes_given_to_load_replace_the_saved_ones_by_name(model, tmp_path) -> None:
    build = _saved(model, tmp_path)
    smaller = neoflow.load(build, shapes={"x": (16, 64)})
    assert smaller.shapes["x"] == (16, 64) and smaller.example_batch(training=True)["x"].shape == (16, 64)
    assert neoflow.load(build).example_batch(training=True)["x"].shape == (32, 64)
