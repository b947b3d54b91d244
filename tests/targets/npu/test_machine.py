"""The NPU machine description: presets, sources, files of one, and the errors bad ones get."""

from __future__ import annotations

import dataclasses
import json

import pytest

from neoflow.errors import CompileError
from neoflow.targets.npu.machine import GM, PRESETS, Buffer, machine


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_figure_of_a_preset_says_where_it_comes_from(name: str) -> None:
    text = machine(name).describe()
    assert "(no source given)" not in text
    assert len(text.splitlines()) > 30  # units, buffers, movers and memory each listed


def test_the_presets_peak_rates_follow_from_their_figures() -> None:
    coupled, split = machine("npu"), machine("npu-split")
    assert coupled.layout == "coupled" and coupled.cube_cores == coupled.vector_cores == 32
    assert coupled.peak_flops == pytest.approx(2 * 16**3 * 32 * 1.0e9)  # ~Ascend 910's 256 TFLOP/s
    assert split.layout == "split" and split.vector_cores == 2 * split.cube_cores  # AIC:AIV = 1:2
    assert {b.on for b in split.buffers} == {"cube", "vector"}
    assert split.buffer("UB").on == "vector" and split.buffer("L0C").on == "cube"


def test_movers_serve_the_paths_ascend_c_documents() -> None:
    coupled, split = machine("npu"), machine("npu-split")
    assert coupled.mover(GM, "L1").name == "MTE2" and coupled.mover("L1", "L0A").name == "MTE1"
    assert coupled.mover("L0C", "UB").name == "FIXPIPE" and coupled.mover("UB", GM).name == "MTE3"
    assert split.mover("L0C", "L1").name == "FIXPIPE"  # separated cores meet through GM/L1, not UB
    with pytest.raises(CompileError, match="moves no data L0C->UB"):
        split.mover("L0C", "UB")
    with pytest.raises(CompileError, match="has no buffer 'L2'"):
        coupled.buffer("L2")


def test_a_machine_file_round_trips_and_can_change_any_figure(tmp_path) -> None:
    path = tmp_path / "mine.json"
    data = machine("npu").to_dict()
    path.write_text(json.dumps(data))
    assert machine(path) == machine("npu")
    data["name"], data["cube_cores"] = "small", 4
    data["vector_cores"] = 4
    data["buffers"][0]["capacity"] = 256 << 10
    path.write_text(json.dumps(data))
    small = machine(str(path))
    assert small.cube_cores == 4 and small.buffer("L1").capacity == 256 << 10
    assert small.peak_flops == machine("npu").peak_flops / 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(layout="ring"), "layout 'ring' is not one of coupled, split"),
        (lambda d: d.update(vector_cores=16), "cube_cores must equal vector_cores"),
        (lambda d: d["buffers"][1].update(capacity=1000), "buffer L0A: capacity 1000 is not a positive multiple"),
        (lambda d: d["buffers"][1].update(alignment=48), "buffer L0A: alignment 48 is not a power of two"),
        (lambda d: d["buffers"][4].update(on="vector"), "buffer UB is on 'vector' cores; a coupled machine has core"),
        (lambda d: d["movers"][0].update(paths=[["GM", "L2"]]), "mover MTE2: path GM->L2 names a place"),
        (lambda d: d["movers"][0].update(name="DMA"), "mover DMA is none of the movers MTE2, MTE1"),
        (lambda d: d.pop("memory"), "missing field 'memory'"),
        (lambda d: d["cube"].update(depth=4), "unexpected keyword argument 'depth'"),
    ],
)
def test_a_bad_machine_file_is_a_one_line_error_naming_the_field(tmp_path, change, message: str) -> None:
    data = machine("npu").to_dict()
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(CompileError, match=message) as caught:
        machine(path)
    assert "\n" not in str(caught.value)


def test_what_is_not_a_machine_says_so(tmp_path) -> None:
    with pytest.raises(CompileError, match="no npu machine 'tpu'"):
        machine("tpu")
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    with pytest.raises(CompileError, match="not readable JSON"):
        machine(garbled)
    garbled.write_text("[1, 2]")
    with pytest.raises(CompileError, match="does not hold an object"):
        machine(garbled)


def test_a_machine_is_checked_however_it_is_made() -> None:
    base = machine("npu")
    with pytest.raises(CompileError, match="buffer L1 is named twice"):
        dataclasses.replace(base, buffers=(*base.buffers, Buffer("L1", 1024, 32, 1, 32, "core")))
