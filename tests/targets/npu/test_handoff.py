"""A split machine's cube cores handing each tile's sums to the vector cores through cross-core flags:
one program, faster than two phases, its values the interpreter's; a dropped cross-core flag caught; a
program reading a GM tensor it writes must name the elements."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import neoflow
from neoflow.codegen.hardware import NPU_CUBE
from neoflow.codegen.implicit_gemm import gemm_views
from neoflow.errors import CompileError
from neoflow.targets.npu import cube
from neoflow.targets.npu.compile import compile_op, pieces_side_by_side
from neoflow.targets.npu.isa import Program, Region, copy
from neoflow.targets.npu.machine import GM, machine
from neoflow.targets.npu.replay import SimulationError, replay
from neoflow.targets.npu.schedule import check_gm_roles, static_schedule
from tests.targets.npu.test_compile import CAPSULE, run_phases

# a product whose epilogue reads another tensor: on a split machine, the vector cores apply it
MASKED = "Y[i, j] = X[i, j] * ReduceAdd({k}, A[i, k] * B[k, j])"
SHAPES = {"X": (1024, 256), "A": (1024, 256), "B": (256, 256)}


@pytest.fixture(scope="module")
def masked():
    op = neoflow.op(MASKED, shapes=SHAPES)
    # two cube cores, four vector cores: each cube core takes several tiles, one after another
    split = dataclasses.replace(machine("npu-split"), cube_cores=2, vector_cores=4)
    return op, compile_op(op, split), compile_op(op, split, hand_off=False)


def test_the_sums_go_tile_by_tile_to_the_vector_cores_and_beat_two_phases(masked) -> None:
    op, handed, phased = masked
    assert [what for what, _ in handed.phases] == ["cube+vector"] and handed.units == "cube+vector"
    assert [what for what, _ in phased.phases] == ["cube", "vector"]
    program, schedule = handed.phases[0][1], handed.schedules[0]
    assert replay(program, against=schedule).starts == schedule.starts
    sets = [i for i in program.instructions if i.is_set and i.peer is not None]
    waits = [i for i in program.instructions if i.is_wait and i.peer is not None]
    npu = program.machine
    assert sets and len(sets) == len(waits)
    assert all(i.core in npu.cores("cube") and i.pipe == "FIXPIPE" and i.peer in npu.cores("vector") for i in sets)
    assert all(i.core in npu.cores("vector") and i.pipe == "MTE2" for i in waits)
    assert f"set_flag FIXPIPE->c{sets[0].peer}.MTE2 #0" in program.listing()
    # the vector cores start on the first sums long before the cube cores store their last
    workspace = f"{op.name}__sums"
    stores = [k for k, i in enumerate(program.instructions) if any(w.tensor == workspace for w in i.writes)]
    loads = [k for k, i in enumerate(program.instructions) if any(r.tensor == workspace for r in i.reads)]
    assert min(schedule.starts[k] for k in loads) < max(schedule.dones[k] for k in stores) / 2
    assert handed.cycles < 0.85 * phased.cycles  # 11738 against 16097 cycles when written


def test_handed_off_sums_compute_what_the_interpreter_does(masked) -> None:
    op, handed, _ = masked
    rng = np.random.default_rng(0)
    inputs = {t.name: rng.standard_normal(t.shape).astype(np.float32) for t in op.inputs}
    want = neoflow.evaluate(op, inputs)
    got = run_phases(handed, inputs)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 2e-3


def test_dropped_cross_core_flags_are_caught(masked) -> None:
    _, handed, _ = masked
    program = handed.phases[0][1]
    # every cross-core flag of one vector core gone: its loads of the sums race the cube's stores
    core = next(i.core for i in program.instructions if i.is_wait and i.peer is not None)
    kept = [i for i in program.instructions if i.peer is None or core not in i.flag_cores]
    assert len(kept) < len(program.instructions)
    with pytest.raises(SimulationError, match="a missing flag"):
        replay(dataclasses.replace(program, instructions=kept))


def _reads_what_it_writes(points: bool, twice: bool = False) -> Program:
    npu = machine("npu-split")
    program = Program(npu, {"T": 256})
    elements = np.arange(64) if points else None
    program.add(copy(npu, 0, Region("L0C", 0, 256), Region(GM, 0, 256, "T", elements), moved=256))
    if twice:
        program.add(copy(npu, 0, Region("L0C", 0, 256), Region(GM, 0, 256, "T", elements), moved=256))
    program.add(copy(npu, 24, Region(GM, 0, 256, "T", elements), Region("UB", 0, 256)))
    return program


def test_a_program_reads_a_gm_tensor_it_writes_only_naming_elements_written_once() -> None:
    check_gm_roles(_reads_what_it_writes(points=True))
    with pytest.raises(CompileError, match="without naming its elements"):
        check_gm_roles(_reads_what_it_writes(points=False))
    with pytest.raises(CompileError, match="written or read before"):
        check_gm_roles(_reads_what_it_writes(points=True, twice=True))
    # without a flag the read, on another core, races the write: the replay names it
    with pytest.raises(SimulationError, match="a missing flag"):
        replay(_reads_what_it_writes(points=True))
    assert static_schedule(_reads_what_it_writes(points=True)).starts[1] > 0  # the schedule waits for the write


def test_lattice_pieces_share_the_cube_cores_by_their_work() -> None:
    op = neoflow.op(CAPSULE.replace("{s}", "2"), shapes={"In": (4, 8, 17, 17, 4, 4), "W": (16, 8, 3, 3, 4, 4)})
    adjoint = neoflow.grad(op)["In"]
    views = gemm_views(adjoint, NPU_CUBE)  # the stride-2 input adjoint's four lattice pieces, 4, 2, 2 and 1 taps
    npu = machine("npu-split")
    cores = len(npu.cores("cube"))
    tiles = [cube.choose_tiles(v, npu, cube.cube_operands(v), cores) for v in views]
    found = pieces_side_by_side(views, tiles, cores)
    assert len(found) == cores
    for v, view in enumerate(views):  # every tile of every piece, once
        assert sorted(k for w, mine in found if w == v for k in mine) == list(
            range(len(cube.tile_order(view, tiles[v])))
        )
    share = {v: sum(w == v for w, _ in found) for v in range(len(views))}
    depth = {v: view.sizes[3] for v, view in enumerate(views)}
    assert min(share.values()) >= 1
    deepest, shallowest = max(depth, key=depth.get), min(depth, key=depth.get)
    assert depth[deepest] > depth[shallowest] and share[deepest] > share[shallowest]
