"""The NPU compiler end to end: ops and training steps compiled to programs whose replay lands on the
static schedule and whose simulated values equal the interpreter's (fp16 operands, fp32 sums);
counters, traces and the build directory; planted faults caught."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path

import numpy as np
import pytest

import neoflow
from neoflow.cli import main
from neoflow.errors import CompileError
from neoflow.targets.npu.compile import compile_op, zeros_land_first
from neoflow.targets.npu.counters import count
from neoflow.targets.npu.data import Footprint
from neoflow.targets.npu.machine import machine
from neoflow.targets.npu.replay import SimulationError, replay
from neoflow.targets.npu.simulate import run_program

MODELS_DIR = Path(__file__).resolve().parents[3] / "models"
CAPSULE = "Out[b, k, p, q, i, j] = ReduceAdd({c, r, s, t}, In[b, c, p*{s} + r, q*{s} + s, i, t] * W[k, c, r, s, t, j])"


def _relative(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


def _inputs(op, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}


def _compiled(op, npu):
    """``op`` compiled for machine ``npu``, every phase's replay landing on its static schedule."""
    compiled = compile_op(op, npu)
    for (_, program), schedule in zip(compiled.phases, compiled.schedules, strict=True):
        assert replay(program, against=schedule).starts == schedule.starts
    return compiled


def _one_core():
    return dataclasses.replace(machine("npu"), cube_cores=1, vector_cores=1)


def _simulate(op, preset="npu") -> tuple[np.ndarray, object]:
    """``op`` compiled for ``preset`` (a preset's name or a machine; replayed against its schedule) and run."""
    compiled = _compiled(op, machine(preset) if isinstance(preset, str) else preset)
    inputs = _inputs(op)
    return run_phases(compiled, inputs), (compiled, neoflow.evaluate(op, inputs))


def run_phases(compiled, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The value of ``compiled``'s op its phases compute from ``inputs`` (the functional simulator)."""
    op = compiled.op
    gm = {k: v.reshape(-1).copy() for k, v in inputs.items()}
    gm[op.name] = np.full(op.output.size, np.nan, np.float32)
    for _, program in compiled.phases:
        for name, size in program.tensors.items():
            gm.setdefault(name, np.full(size // 4, np.nan, np.float32))
        run_program(program, gm)
    return gm[op.name].reshape(op.shape)


@pytest.mark.parametrize("preset", ["npu", "npu-split"])
def test_a_gemm_with_bias_and_relu_runs_on_the_cube_with_the_epilogue_in_fixpipe(preset: str) -> None:
    op = neoflow.op(
        "C[i, j] = max(ReduceAdd({k}, A[i, k] * B[k, j]) + bias[j], 0)",
        shapes={"A": (90, 70), "B": (70, 50), "bias": (50,)},
    )
    got, (compiled, want) = _simulate(op, preset)
    assert [what for what, _ in compiled.phases] == ["cube"]
    assert _relative(got, want) < 2e-3  # fp16 operands, fp32 sums
    text = compiled.phases[0][1].listing()
    for opcode in ("mte2.copy", "mte1.img2col", "cube.mmad", "fixpipe.store", "set_flag", "wait_flag"):
        assert opcode in text, opcode


def test_a_padded_convolution_gathers_its_input_window_not_an_im2col_copy() -> None:
    op = neoflow.op(
        "Y[n, k, p, q] = ReduceAdd({c, r, s}, Select(p + r - 1 >= 0 && p + r - 1 < 12 && q + s - 1 >= 0 "
        "&& q + s - 1 < 12, X[n, c, p + r - 1, q + s - 1], 0) * W[k, c, r, s])",
        shapes={"X": (2, 8, 12, 12), "W": (16, 8, 3, 3), "Y": (2, 16, 12, 12)},
    )
    got, (compiled, want) = _simulate(op)
    assert _relative(got, want) < 2e-3
    program = compiled.phases[0][1]
    loaded = sum(
        i.data.offsets.size for i in program.instructions if isinstance(i.data, Footprint) and i.data.tensor == "X"
    )
    expanded = sum(  # what an im2col copy of X would hold: every (row, depth) of every tile
        len(i.data.rows) * len(i.data.depth)
        for i in program.instructions
        if i.opcode == "mte1.img2col" and i.data.side == "a"
    )
    assert loaded < expanded / 2  # the 3x3 window's overlap is loaded once per tile


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("preset", ["npu", "npu-split"])
def test_capsule_conv_forward_and_backward(stride: int, preset: str) -> None:
    op = neoflow.op(
        CAPSULE.replace("{s}", str(stride)),
        shapes={"In": (2, 4, 4 + 2 * stride + 1, 4 + 2 * stride + 1, 4, 4), "W": (8, 4, 3, 3, 4, 4)},
    )
    layer = neoflow.compile(op, target=preset, grad=True)
    reference = neoflow.compile(op, target="interp", grad=True)
    inputs = _inputs(op)
    out = layer.run(inputs)
    assert _relative(out, reference.run(inputs)) < 2e-3
    dout = {"dOut": np.random.default_rng(1).standard_normal(out.shape).astype(np.float32)}
    grads, want = layer.backward(inputs, dout), reference.backward(inputs, dout)
    for name in ("In", "W"):
        assert _relative(grads[name], want[name]) < 2e-3, name
    units = {c.units for c in layer._backward.programs.values()}
    assert "cube" in units  # the adjoints (the stride-2 input adjoint's lattice pieces too) on the cube


@pytest.mark.parametrize(
    "text, shapes",
    [
        ("Y[i, j] = exp(X[i, j] - 1) * 2 + Z[j]", {"X": (50, 40), "Z": (40,)}),
        ("Y[i] = ReduceAdd({j}, X[i, j] * X[i, j])", {"X": (20, 5000)}),  # cut along its domain in UB
        ("Y[i] = ReduceMax({j}, X[i, j])", {"X": (300, 70)}),
        ("Y[n] = log(ReduceAdd({c}, exp(X[n, c] - ReduceMax({d}, X[n, d]))))", {"X": (64, 10)}),
    ],
)
@pytest.mark.parametrize("preset", ["npu", "npu-split"])
def test_vector_ops(text: str, shapes, preset: str) -> None:
    op = neoflow.op(text, shapes=shapes)
    got, (compiled, want) = _simulate(op, preset)
    assert compiled.units == "vector"
    assert _relative(got, want) < 1e-5


@pytest.mark.parametrize(
    "shapes", [{"W": (24, 40), "G": (32, 24), "X": (32, 40)}, {"W": (200, 136), "G": (48, 200), "X": (48, 136)}]
)
def test_an_epilogue_reading_other_tensors_runs_on_chip_beside_the_cube(shapes) -> None:
    """On a coupled machine FIXPIPE drains the sums into UB, the same core's vector unit applies the
    epilogue (reading W) and MTE3 stores it: the sums never visit GM."""
    op = neoflow.op("Wn[i, j] = W[i, j] - 0.1 * ReduceAdd({b}, G[b, i] * X[b, j])", shapes=shapes)
    got, (compiled, want) = _simulate(op)
    assert [what for what, _ in compiled.phases] == ["cube"]
    program = compiled.phases[0][1]
    opcodes = [i.opcode for i in program.instructions]
    assert "vec.epilogue" in opcodes
    assert all(i.writes[0].space == "UB" for i in program.instructions if i.opcode == "fixpipe.store")
    assert set(program.tensors) == {"W", "G", "X", "Wn"}  # no workspace
    assert _relative(got, want) < 2e-3
    # the split machine's workspace round trip moves the fp32 sums through GM twice: FIXPIPE out, then
    # the vector phase back in; the coupled machine's FIXPIPE drains into UB alone
    _, (split, _) = _simulate(op, "npu-split")
    phased = compile_op(op, machine("npu-split"), hand_off=False)
    # tile by tile (``handoff``) where that is faster, else the two phases; never slower than them
    assert split.cycles <= phased.cycles
    assert [what for what, _ in split.phases] == (
        ["cube+vector"] if split.cycles < phased.cycles else ["cube", "vector"]
    )
    moved = [count(p, s).paths for (_, p), s in zip(split.phases, split.schedules, strict=True)]
    assert sum(m["L0C->GM"] for m in moved) >= op.output.size * 4 <= sum(m["GM->UB"] for m in moved)
    assert "L0C->GM" not in count(program, compiled.schedules[0]).paths
    # one core takes every tile: the UB halves ping-pong between tiles
    got, (alone, want) = _simulate(op, _one_core())
    assert sum(i.opcode == "vec.epilogue" for i in alone.phases[0][1].instructions) >= (
        3 if shapes["W"][0] > 100 else 1
    )
    assert _relative(got, want) < 2e-3


def test_an_epilogue_reading_other_tensors_runs_from_a_workspace_on_a_split_machine() -> None:
    op = neoflow.op(
        "Wn[i, j] = W[i, j] - 0.1 * ReduceAdd({b}, G[b, i] * X[b, j])",
        shapes={"W": (24, 40), "G": (32, 24), "X": (32, 40)},
    )
    got, (compiled, want) = _simulate(op, "npu-split")
    phased = compile_op(op, machine("npu-split"), hand_off=False)
    assert [what for what, _ in phased.phases] == ["cube", "vector"]
    # handed off tile by tile where that is faster (``test_handoff``), else the same two phases
    assert compiled.cycles <= phased.cycles
    assert [what for what, _ in compiled.phases] == (
        ["cube+vector"] if compiled.cycles < phased.cycles else ["cube", "vector"]
    )
    assert _relative(got, want) < 2e-3


@pytest.mark.parametrize(
    "model, shape",
    [("mlp.onnx", (32, 64)), ("cnn.onnx", (32, 1, 8, 8)), ("capsule.onnx", (32, 1, 8, 8))],
)
def test_training_steps_match_the_interpreter(model: str, shape) -> None:
    spec = neoflow.TrainSpec(labels="y", optimizer="sgd", lr=0.05)
    rng = np.random.default_rng(0)
    # values fp16 holds exactly: the first layer then differs from the interpreter in the order of sums alone
    batch = {"x": rng.standard_normal(shape).astype(np.float16).astype(np.float32), "y": rng.integers(0, 10, shape[0])}
    ours = neoflow.compile(MODELS_DIR / model, target="npu", train=spec, fusion="neoflow")
    reference = neoflow.compile(MODELS_DIR / model, target="interp", train=spec, fusion="neoflow")
    exact = {k: v.astype(np.float16).astype(np.float32) for k, v in reference.parameters().items()}
    ours.set_parameters(exact)
    reference.set_parameters(exact)
    got, want = ours.gradients(batch), reference.gradients(batch)
    for name in want:
        assert _relative(got[name], want[name]) < 5e-3, name  # fp16 operands past the first layer
    assert ours.train_step(batch) == pytest.approx(reference.train_step(batch), rel=2e-3)
    assert any(c.units.startswith("cube") for c in ours._train.programs.values())


def test_counters_add_up_and_the_timeline_opens_as_a_trace(tmp_path: Path) -> None:
    npu = machine("npu")
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (256, 512), "B": (512, 256)})
    compiled = _compiled(op, dataclasses.replace(npu, cube_cores=1, vector_cores=1))
    program, schedule = compiled.phases[0][1], compiled.schedules[0]
    counters = count(program, schedule)
    assert counters.macs == 256 * 512 * 256
    assert counters.busy["CUBE"] == counters.macs // npu.cube.macs_per_cycle  # whole fractals: no waste
    assert counters.paths["L1->L0A"] + counters.paths["L1->L0B"] > 0
    assert counters.paths["L0C->GM"] == 256 * 256 * 4
    assert counters.paths["GM->L1"] >= (256 * 512 + 512 * 256) * 4
    assert counters.hbm_bytes == (256 * 512 + 512 * 256) * 4  # each input element fetched from HBM once
    assert 0 < counters.cube_utilization() <= 1
    assert counters.peak["L0C"] <= npu.buffer("L0C").capacity
    assert set(counters.stalls) <= {"data", "buffer", "unit"}
    layer = neoflow.compile(op, target="npu")
    layer.run(_inputs(op))
    executor = layer._forward
    trace = json.loads(executor.trace())
    pipes = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"MTE2", "MTE1", "CUBE", "FIXPIPE"} <= pipes
    assert any(e.get("name") == "cube.mmad" and e["dur"] > 0 for e in trace["traceEvents"])
    assert executor.counters is not None and executor.counters.macs == 256 * 512 * 256
    executor.gantt(tmp_path / "gantt.png")
    assert (tmp_path / "gantt.png").stat().st_size > 1000
    assert "| CUBE |" in executor.report()


def test_a_dropped_flag_in_a_compiled_program_is_caught() -> None:
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (64, 256), "B": (256, 64)})
    program = _compiled(op, _one_core()).phases[0][1]
    for dropped in ("MTE2", "MTE1"):
        broken = dataclasses.replace(program, instructions=list(program.instructions))
        first = next(
            k
            for k, i in enumerate(broken.instructions)
            if i.opcode == "set_flag" and i.event[:2] == (dropped, "MTE1" if dropped == "MTE2" else "CUBE")
        )
        wait = next(
            k for k, i in enumerate(broken.instructions) if i.is_wait and i.event == broken.instructions[first].event
        )
        del broken.instructions[wait]
        del broken.instructions[first]
        with pytest.raises(SimulationError, match="a missing flag"):
            replay(broken)


def test_a_patch_missing_an_element_is_caught_by_the_functional_simulator() -> None:
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (32, 32), "B": (32, 32)})
    program = _compiled(op, _one_core()).phases[0][1]
    position = next(k for k, i in enumerate(program.instructions) if isinstance(i.data, Footprint))
    load = program.instructions[position]
    short = Footprint(load.data.tensor, load.data.offsets[1:], load.data.itemsize)
    program.instructions[position] = dataclasses.replace(load, data=short)
    gm = {name: np.zeros(size // 4, np.float32) for name, size in program.tensors.items()}
    with pytest.raises(SimulationError, match="not in the L1 patch"):
        run_program(program, gm)


def test_the_npu_takes_no_tensor_core_precision() -> None:
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (16, 16), "B": (16, 16)})
    with pytest.raises(CompileError, match="fp16"):
        neoflow.compile(op, target="npu", precision="tf32")


def test_cli_writes_the_program_schedule_trace_and_report_and_runs_them(tmp_path: Path, capsys) -> None:
    model = str(MODELS_DIR / "capsule.onnx")
    assert main(["compile", model, "--target", "npu-split", "--train", "--labels", "y", "-o", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}
    for role in ("inference", "train_step"):
        assert {f"{role}.program.s", f"{role}.schedule.csv", f"{role}.trace.json", f"{role}.npu-report.txt"} <= names
    listing = (tmp_path / "train_step.program.s").read_text()
    assert "cube.mmad" in listing and "vec." in listing and "@" in listing
    capsys.readouterr()
    assert main(["run", str(tmp_path), "--random"]) == 0
    printed = capsys.readouterr().out
    assert "cube utilization" in printed and "| MTE2 |" in printed


def test_fuse_compares_policies_by_simulated_cycles(capsys) -> None:
    model = str(MODELS_DIR / "cnn.onnx")
    assert main(["fuse", model, "--train", "--labels", "y", "--target", "npu", "--compare", "none,neoflow"]) == 0
    printed = capsys.readouterr().out
    assert "policies compared" in printed and "| neoflow |" in printed
    spec = neoflow.TrainSpec(labels="y")
    cycles = {
        policy: neoflow.compile(MODELS_DIR / "cnn.onnx", target="npu", train=spec, fusion=policy)._train.total().cycles
        for policy in ("none", "neoflow")
    }
    assert cycles["neoflow"] < cycles["none"]  # fused kernels keep intermediates on chip


def test_a_deep_contraction_with_few_tiles_splits_its_depth_across_cores() -> None:
    # a weight gradient: a 32 x 32 output summed over 4096 batch points; one tile would leave 31 cores idle
    op = neoflow.op("dW[k, c] = ReduceAdd({b}, G[b, k] * X[b, c])", shapes={"G": (4096, 32), "X": (4096, 32)})
    got, (compiled, want) = _simulate(op)
    # the workspace's zeros are stored by the vector units in the cube phase, done before any sum lands
    assert [what for what, _ in compiled.phases] == ["cube", "vector"]
    cube_phase, schedule = compiled.phases[0][1], compiled.schedules[0]
    zeros = [i for i in cube_phase.instructions if i.data == "zero"]
    assert zeros and all(i.pipe == "MTE3" for i in zeros)
    assert zeros_land_first(cube_phase, schedule, zeros[0].writes[0].tensor)
    atomic = [i for i in cube_phase.instructions if i.opcode == "fixpipe.store"]
    assert len(atomic) > 1 and all(dict(i.args)["atomic_add"] for i in atomic)
    assert len({i.core for i in atomic}) == len(atomic)  # each split on a core of its own
    assert _relative(got, want) < 2e-3
    # a sum scheduled before the zeros are done would be lost: then the zeros take a phase of their own
    early = dataclasses.replace(
        schedule,
        starts=tuple(
            0 if i.opcode == "fixpipe.store" else t
            for i, t in zip(cube_phase.instructions, schedule.starts, strict=True)
        ),
    )
    assert not zeros_land_first(cube_phase, early, zeros[0].writes[0].tensor)
    one_core = _compiled(op, _one_core())
    assert compiled.cycles < one_core.cycles / 4
    # the vector pass over the workspace converts each sum once: a lane a point, not the product's arithmetic
    npu = machine("npu")
    for instruction in compiled.phases[1][1].instructions:
        if instruction.opcode == "vec.epilogue":
            points = dict(instruction.args)["points"]
            assert instruction.cycles == -(-points * 4 // npu.vector.repeat_bytes)


def test_first_reads_share_hbm_across_the_cores() -> None:
    # 32 cores reading a 16 MiB input at once cannot beat HBM: 1200 bytes a cycle on `npu`
    npu = machine("npu")
    op = neoflow.op("Y[i, j] = X[i, j] * 2", shapes={"X": (2048, 2048)})
    compiled = _compiled(op, npu)
    hbm_floor = op.inputs[0].size * 4 / npu.memory.hbm_bytes_per_cycle
    assert compiled.cycles >= hbm_floor
    loads = [i for i in compiled.phases[0][1].instructions if i.opcode == "mte2.copy"]
    assert sum(i.hbm for i in loads) == op.inputs[0].size * 4


def test_the_npu_plans_no_sliced_kernels_it_would_not_realise() -> None:
    spec = neoflow.TrainSpec(labels="y")
    compiled = neoflow.compile(MODELS_DIR / "cnn.onnx", target="npu", train=spec, fusion="neoflow")
    assert not any(kernel.sliced for kernel in compiled._train.fusion_plan.kernels)


def test_a_machine_whose_buffers_hold_no_tile_is_a_one_line_error() -> None:
    npu = machine("npu")
    tiny = tuple(dataclasses.replace(b, capacity=512) if b.name == "L0A" else b for b in npu.buffers)
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (64, 64), "B": (64, 64)})
    with pytest.raises(CompileError, match="no cube tile fits") as caught:
        compile_op(op, dataclasses.replace(npu, buffers=tiny))
    assert "\n" not in str(caught.value)


def _machine_file(tmp_path: Path, cores: int) -> Path:
    """A user's machine: the ``npu`` preset with ``cores`` cores, as a JSON file."""
    data = machine("npu").to_dict()
    data.update(name="my-npu", cube_cores=cores, vector_cores=cores)
    path = tmp_path / "my-npu.json"
    path.write_text(json.dumps(data))
    return path


def test_a_users_machine_file_is_a_target(tmp_path: Path) -> None:
    from neoflow import targets
    from neoflow.ir.graph import Graph

    path = _machine_file(tmp_path, 4)
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (256, 128), "B": (128, 256)})
    inputs = _inputs(op)
    layer = neoflow.compile(op, target=f"npu:{path}", grad=True)
    assert _relative(layer.run(inputs), neoflow.evaluate(op, inputs)) < 2e-3
    cycles = {}
    for name in ("npu", f"npu:{path}"):
        executor = targets.target(name).executor(Graph.from_ops([op]), [op.name])
        executor.run(inputs)
        cycles[executor.machine.cube_cores] = executor.counters.cycles
    assert cycles[4] > cycles[32]  # four cores take longer than the preset's 32


def test_a_build_keeps_its_machine_file_and_a_bad_one_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    path = _machine_file(tmp_path, 2)
    build = tmp_path / "build"
    model = str(MODELS_DIR / "mlp.onnx")
    assert main(["compile", model, "--target", f"npu:{path}", "-o", str(build)]) == 0
    assert json.loads((build / "machine.json").read_text())["cube_cores"] == 2
    assert json.loads((build / "manifest.json").read_text())["target"] == "npu:machine.json"
    path.unlink()  # the build runs on its own copy
    capsys.readouterr()
    assert main(["run", str(build), "--random"]) == 0
    assert "cube utilization" in capsys.readouterr().out
    broken = tmp_path / "broken.json"
    broken.write_text('{"name": "x"')
    assert main(["compile", model, "--target", f"npu:{broken}", "-o", str(tmp_path / "other")]) != 0
    error = capsys.readouterr().err.strip()
    assert error.startswith("neoflow") and "\n" not in error and "broken.json" in error
    assert not (tmp_path / "other").exists()
    with pytest.raises(CompileError, match="unknown target"):
        neoflow.compile(MODELS_DIR / "mlp.onnx", target="gpu:x.json")


def test_output_tiles_spread_evenly_over_the_cores() -> None:
    # 3,584 rows: 32 tiles of 112 (one a core); tiles of 128 would leave four of the 32 cores idle
    op = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (3584, 256), "B": (256, 64)}, dtype="float16"
    )
    compiled = _compiled(op, machine("npu"))
    busy: dict[int, int] = {}
    for _, program in compiled.phases:
        for instruction in program.instructions:
            if instruction.opcode == "cube.mmad":
                busy[instruction.core] = busy.get(instruction.core, 0) + instruction.cycles
    assert len(busy) == 32 and min(busy.values()) == max(busy.values())


def test_cores_reading_the_same_weights_share_their_fetch_from_hbm() -> None:
    # every core multiplies by all of B: each pays a 32nd of B's fetch, not the first core all of it
    op = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (3584, 256), "B": (256, 64)}, dtype="float16"
    )
    compiled = _compiled(op, machine("npu"))
    fetched: dict[int, int] = {}
    for _, program in compiled.phases:
        for instruction in program.instructions:
            if instruction.opcode == "mte2.copy":
                fetched[instruction.core] = fetched.get(instruction.core, 0) + instruction.hbm
    assert sum(fetched.values()) == sum(t.size * 2 for t in op.inputs)
    a_share, b_share = 112 * 256 * 2, 256 * 64 * 2 / 32
    assert all(abs(bytes_ - (a_share + b_share)) <= 2 for bytes_ in fetched.values())


@pytest.mark.parametrize("k_size, k1, splits", [(25088, 128, 16), (1000, 64, 8), (96, 32, 8), (12544, 128, 4)])
def test_split_depth_ranges_are_even_whole_steps_covering_the_depth(k_size: int, k1: int, splits: int) -> None:
    from neoflow.targets.npu.cube import CubeTiles

    ranges = CubeTiles(16, 16, 16, k1, splits).depth_ranges(k_size)
    assert ranges[0].start == 0 and ranges[-1].stop == k_size
    assert all(a.stop == b.start for a, b in itertools.pairwise(ranges))
    assert all(r.start % k1 == 0 and len(r) > 0 for r in ranges)
    steps = [-(-len(r) // k1) for r in ranges]
    assert max(steps) - min(steps) <= 1  # 196 steps in 16 splits: 12 or 13 each, not 13 and a last of 1
    assert len(ranges) == min(splits, -(-k_size // k1))


def test_a_lone_view_may_take_all_of_l0c_for_one_tile_a_core(monkeypatch) -> None:
    """Tiles of more than half of L0C are offered only for a program's lone view and only where every core
    gets one tile at most; such a tiling computes right and its replay lands on its schedule."""
    from neoflow.codegen.hardware import NPU_CUBE
    from neoflow.codegen.implicit_gemm import gemm_views
    from neoflow.targets.npu import compile as npu_compile
    from neoflow.targets.npu import cube

    base = machine("npu")
    small = dataclasses.replace(
        base,
        cube_cores=4,
        vector_cores=4,
        buffers=tuple(dataclasses.replace(b, capacity=64 * 1024) if b.name == "L0C" else b for b in base.buffers),
    )
    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (256, 512), "B": (512, 256)})
    view = gemm_views(op, NPU_CUBE)[0]
    gathers = cube.cube_operands(view)
    shared = cube.tile_candidates(view, small, gathers, 4)
    lone = cube.tile_candidates(view, small, gathers, 4, lone=True)
    assert not any(cube.whole_l0c(t, small) for t in shared)
    whole = [t for t in lone if cube.whole_l0c(t, small)]
    assert whole and all(math.ceil(256 / t.m) * math.ceil(256 / t.n) * t.splits <= 4 for t in whole)
    monkeypatch.setattr(cube, "tile_candidates", lambda *a, **k: whole[:1])
    monkeypatch.setattr(npu_compile, "TRIALS", 2)  # the one whole tiling offered is the one tried
    got, (compiled, want) = _simulate(op, small)
    assert _relative(got, want) < 2e-3
    assert count(compiled.phases[0][1], compiled.schedules[0]).peak["L0C"] > small.buffer("L0C").capacity // 2


def test_a_weight_every_row_tile_reads_stays_in_l1_and_is_loaded_once() -> None:
    # one core, 16 row tiles of A against the same columns of B: B's patches are loaded once and kept
    op = neoflow.op(
        "C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (2048, 256), "B": (256, 64)}, dtype="float16"
    )
    got, (compiled, want) = _simulate(op, _one_core())
    assert _relative(got, want) < 2e-3
    program = compiled.phases[0][1]
    loads = {
        name: [i.data for i in program.instructions if isinstance(i.data, Footprint) and i.data.tensor == name]
        for name in ("A", "B")
    }
    assert sum(f.offsets.size for f in loads["B"]) == 256 * 64  # each element of B once
    assert len(loads["A"]) > len(loads["B"])  # while A's patches stream through the ping-pong halves
    b_regions = [i.writes[0] for i in program.instructions if isinstance(i.data, Footprint) and i.data.tensor == "B"]
    assert len({(r.offset, r.size) for r in b_regions}) == len(b_regions)  # each at a place of its own


@pytest.fixture
def weighed(monkeypatch) -> list:
    """Every (program, static schedule) the compiler schedules from here on, kept or not."""
    import neoflow.targets.npu.compile as npu_compile
    from neoflow.targets.npu.schedule import static_schedule

    found = []

    def scheduled(program):
        schedule = static_schedule(program)
        found.append((program, schedule))
        return schedule

    monkeypatch.setattr(npu_compile, "static_schedule", scheduled)
    return found


def test_every_tiling_weighed_lands_on_its_schedule(weighed) -> None:
    # the tilings weighed (the busiest core alone, timed on its static schedule) are programs too: an
    # on-chip epilogue whose chunks differ in size once let a chunk's inputs land over the result two
    # chunks before it while MTE3 still stored that result (W 200 x 136 on one core: a missing flag)
    op = neoflow.op(
        "Wn[i, j] = W[i, j] - 0.1 * ReduceAdd({b}, G[b, i] * X[b, j])",
        shapes={"W": (200, 136), "G": (48, 200), "X": (48, 136)},
    )
    compile_op(op, _one_core())
    assert len(weighed) > 1
    for program, schedule in weighed:
        assert replay(program, against=schedule).starts == schedule.starts


def test_a_chunk_writing_where_the_last_result_of_its_half_lies_waits_for_its_store() -> None:
    from neoflow.targets.npu.cube import _after_store, _Flags
    from neoflow.targets.npu.isa import Program, Region

    program = Program(_one_core(), {})
    flags = _Flags(program, 0)
    stored = {0: Region("UB", 1000, 500)}
    _after_store(flags, "MTE2", 0, [Region("UB", 0, 512)], stored)  # apart: no flag
    _after_store(flags, "MTE2", 1, [Region("UB", 1200, 64)], stored)  # the other half: nothing stored
    assert program.instructions == []
    _after_store(flags, "FIXPIPE", 0, [Region("UB", 0, 512), Region("UB", 1400, 64)], stored)
    assert [(i.opcode, i.pipe, i.event) for i in program.instructions] == [
        ("set_flag", "MTE3", ("MTE3", "FIXPIPE", 0)),
        ("wait_flag", "FIXPIPE", ("MTE3", "FIXPIPE", 0)),
    ]


def _with_ub(npu, capacity: int):
    """``npu`` with a UB of ``capacity`` bytes."""
    return dataclasses.replace(
        npu, buffers=tuple(dataclasses.replace(b, capacity=capacity) if b.name == "UB" else b for b in npu.buffers)
    )


#: a stride-2 capsule convolution's input adjoint under its ReLU mask (``A``): four lattice pieces, the
#: mask read by an epilogue on chip
MASKED_ADJOINT = (
    "G[b, c, h, w, i, t] = ReduceAdd({k, j, r, s | (h - r)%2 == 0 && (w - s)%2 == 0 && (h - r)//2 >= 0 && "
    "(h - r)//2 < 2 && (w - s)//2 >= 0 && (w - s)//2 < 2}, D[b, k, (h - r)//2, (w - s)//2, i, j] * "
    "W[k, c, r, s, t, j]) * Select(A[b, c, h, w, i, t] > 0, 1, 0)"
)


def test_lattice_pieces_a_column_apart_load_their_epilogue_inputs_once(monkeypatch) -> None:
    import neoflow.targets.npu.compile as npu_compile
    from neoflow.codegen.hardware import NPU_CUBE
    from neoflow.codegen.implicit_gemm import gemm_views
    from neoflow.targets.npu import cube

    shapes = {"D": (8, 4, 2, 2, 1, 2), "W": (4, 4, 3, 3, 2, 2), "A": (8, 4, 6, 6, 1, 2)}
    op = neoflow.op(MASKED_ADJOINT, shapes=shapes, out_shape=(8, 4, 6, 6, 1, 2))
    npu = machine("npu")
    # the pieces of odd and even columns share the mask's GM sectors; those of odd and even rows do not
    views = gemm_views(op, NPU_CUBE)
    members = [(v, cube.cube_operands(v), cube.CubeTiles(16, 16, 16, 16)) for v in views]
    assert [v.out_offset.as_coefficients_dict()[1] for v in views] == [0, 2, 12, 14]
    groups = npu_compile.sibling_groups(*zip(*members, strict=True), 4, npu)
    assert groups == [[0, 1], [2, 3]]
    assert not cube.siblings([members[0], members[2]], 4, npu)

    def mask_bytes(compiled) -> int:
        program = compiled.phases[0][1]
        return sum(i.moved for i in program.instructions if isinstance(i.data, Footprint) and i.data.tensor == "A")

    got, (paired, want) = _simulate(op)
    assert _relative(got, want) < 2e-3
    monkeypatch.setattr(npu_compile, "sibling_groups", lambda views, *_: [[v] for v in range(len(views))])
    got_alone, (alone, _) = _simulate(op)
    assert _relative(got_alone, want) < 2e-3
    # each piece alone moves whole 32-byte sectors for its 8-byte runs of the mask: four times its bytes
    size = op.inputs[2].size * 4
    assert mask_bytes(alone) == 4 * size
    assert mask_bytes(paired) < 1.5 * size
    assert paired.cycles <= alone.cycles  # kept as it is no slower
    tiles = [i.data for i in paired.phases[0][1].instructions if i.opcode == "vec.epilogue"]
    assert len(tiles) == 2 * len(
        [i for i in paired.phases[0][1].instructions if i.opcode == "mte2.copy" and i.data.tensor == "A"]
    )


def test_sibling_pieces_whose_chunks_overflow_a_ub_half_together_stay_apart() -> None:
    from neoflow.codegen.hardware import NPU_CUBE
    from neoflow.codegen.implicit_gemm import gemm_views
    from neoflow.targets.npu import cube

    shapes = {"D": (8, 4, 2, 2, 1, 2), "W": (4, 4, 3, 3, 2, 2), "A": (8, 4, 6, 6, 1, 2)}
    op = neoflow.op(MASKED_ADJOINT, shapes=shapes, out_shape=(8, 4, 6, 6, 1, 2))
    base = machine("npu")
    # a UB half of 4 KiB holds the chunk of 16 rows of one piece's 8 columns (sums, mask and result,
    # 1.5 KiB, and room to align), not two pieces' (3 KiB, and more room): the sweep's quarter-size UB
    # once overflowed so on capsule28's input adjoint
    small = _with_ub(base, 8192)
    views = gemm_views(op, NPU_CUBE)
    members = [(v, cube.cube_operands(v), cube.CubeTiles(16, 16, 16, 16)) for v in views]
    assert cube.siblings(members[:2], 4, base)
    assert not cube.siblings(members[:2], 4, small)
    got, (compiled, want) = _simulate(op, small)
    assert _relative(got, want) < 2e-3
    program = compiled.phases[0][1].instructions
    mask_loads = [i for i in program if isinstance(i.data, Footprint) and i.data.tensor == "A"]
    assert len(mask_loads) == sum(i.opcode == "vec.epilogue" for i in program)  # the pieces apart: a load each


def test_every_program_the_sibling_pieces_weigh_lands_on_its_schedule(weighed) -> None:
    # the pieces apart and paired are both scheduled (the faster kept): each replays onto its schedule,
    # on the full machine and on one whose UB holds the pieces' chunks only apart
    shapes = {"D": (8, 4, 2, 2, 1, 2), "W": (4, 4, 3, 3, 2, 2), "A": (8, 4, 6, 6, 1, 2)}
    op = neoflow.op(MASKED_ADJOINT, shapes=shapes, out_shape=(8, 4, 6, 6, 1, 2))
    base = machine("npu")
    small = _with_ub(base, 8192)
    for npu in (base, small):
        compile_op(op, npu)
    paired = [
        p
        for p, _ in weighed
        if sum(i.opcode == "vec.epilogue" for i in p.instructions)
        > sum(isinstance(i.data, Footprint) and i.data.tensor == "A" for i in p.instructions)
    ]
    assert paired  # the paired program was among those weighed
    for program, schedule in weighed:
        assert replay(program, against=schedule).starts == schedule.starts
