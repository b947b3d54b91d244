"""Static schedules and their replay: a double-buffered matrix product on one core, and the errors a
broken program gets (a missing flag, an overflowing or misaligned tile, a GM access out of bounds)."""

from __future__ import annotations

import dataclasses

import pytest

from neoflow.errors import CompileError
from neoflow.targets.npu.isa import Program, Region, copy, mmad, set_flag, vector, wait_flag
from neoflow.targets.npu.machine import GM, machine
from neoflow.targets.npu.replay import SimulationError, replay
from neoflow.targets.npu.schedule import static_schedule

TILE = 64 * 64 * 2  # a 64 x 64 fp16 tile


def gemm(chunks: int = 6, drop: str | None = None) -> Program:
    """C (64 x 64) = A (64 x 64 chunks) @ B: GM -> L1 -> L0A/L0B -> cube -> GM, L1 and L0 halves
    ping-ponged, every hand-over flagged (``drop``: the flag left out, ``MTE1->CUBE``)."""
    npu = machine("npu")
    program = Program(npu, {"A": chunks * TILE, "B": chunks * TILE, "C": 64 * 64 * 4})
    add = program.add

    def flag(source: str, destination: str, number: int) -> None:
        if drop == f"{source}->{destination}":
            return
        add(set_flag(0, source, destination, number))

    def wait(source: str, destination: str, number: int) -> None:
        if drop == f"{source}->{destination}":
            return
        add(wait_flag(0, source, destination, number))

    l0c = Region("L0C", 0, 64 * 64 * 4)
    for k in range(chunks):
        half = k % 2
        l1_a, l1_b = Region("L1", half * 2 * TILE, TILE), Region("L1", half * 2 * TILE + TILE, TILE)
        l0a, l0b = Region("L0A", half * TILE, TILE), Region("L0B", half * TILE, TILE)
        if k >= 2:
            wait("MTE1", "MTE2", half)  # L1 half free again
        add(copy(npu, 0, Region(GM, k * TILE, TILE, "A"), l1_a))
        add(copy(npu, 0, Region(GM, k * TILE, TILE, "B"), l1_b))
        flag("MTE2", "MTE1", half)
        wait("MTE2", "MTE1", half)
        if k >= 2:
            wait("CUBE", "MTE1", half)  # L0 half free again
        add(copy(npu, 0, l1_a, l0a))
        add(copy(npu, 0, l1_b, l0b))
        flag("MTE1", "MTE2", half)
        flag("MTE1", "CUBE", half)
        wait("MTE1", "CUBE", half)
        add(mmad(npu, 0, l0a, l0b, l0c, 64, 64, 64, init=k == 0))
        flag("CUBE", "MTE1", half)
    flag("CUBE", "FIXPIPE", 0)
    wait("CUBE", "FIXPIPE", 0)
    add(copy(npu, 0, l0c, Region(GM, 0, 64 * 64 * 4, "C")))
    return program


@pytest.mark.parametrize("chunks", [1, 2, 3, 6])
def test_the_replay_lands_on_every_cycle_of_the_static_schedule(chunks: int) -> None:
    program = gemm(chunks)
    schedule = static_schedule(program)
    assert replay(program, against=schedule) == schedule


def test_copies_overlap_the_cube_through_the_ping_pong_halves() -> None:
    program = gemm()
    schedule = static_schedule(program)
    serial = sum(i.cycles + i.latency for i in program.instructions)
    assert schedule.cycles < serial  # copies overlap the cube through the ping-pong halves
    mte2 = [k for k, i in enumerate(program.instructions) if i.pipe == "MTE2"]
    cube = [k for k, i in enumerate(program.instructions) if i.opcode == "cube.mmad"]
    # the third chunk's copies in run while the first chunks are multiplied
    assert schedule.starts[mte2[4]] < schedule.dones[cube[1]]


def test_the_listing_shows_every_instruction_with_its_cycle() -> None:
    program = gemm(chunks=2)
    schedule = static_schedule(program)
    assert replay(program, against=schedule) == schedule
    text = program.listing(schedule.starts)
    for opcode in ("mte2.copy", "mte1.copy", "cube.mmad", "fixpipe.store", "set_flag MTE1->CUBE #0", "wait_flag"):
        assert opcode in text
    assert "c0.CUBE" in text and "@" in text and "GM:A[0:8192]" in text


def test_a_missing_flag_is_caught_naming_the_instruction() -> None:
    program = gemm(drop="MTE1->CUBE")
    with pytest.raises(SimulationError, match=r"instruction \d+ \(c0\.CUBE cube\.mmad .*missing flag"):
        replay(program)
    with pytest.raises(SimulationError, match=r"moved|missing flag"):
        replay(program, against=static_schedule(program))


def _replace(program: Program, opcode: str, **change) -> Program:
    """``program`` with the first ``opcode`` instruction's first write changed."""
    k = next(k for k, i in enumerate(program.instructions) if i.opcode == opcode)
    first = program.instructions[k]
    target = dataclasses.replace(first.writes[0], **change)
    program.instructions[k] = dataclasses.replace(first, writes=(target, *first.writes[1:]))
    return program


def test_a_tile_over_its_buffer_a_misaligned_one_and_gm_out_of_bounds_are_errors() -> None:
    with pytest.raises(SimulationError, match=r"mte1\.copy .*overflows L0A \(65536 bytes\)"):
        replay(_replace(gemm(), "mte1.copy", offset=60 << 10))
    with pytest.raises(SimulationError, match=r"is not aligned to 512 bytes"):
        replay(_replace(gemm(), "mte1.copy", offset=100))
    with pytest.raises(SimulationError, match=r"fixpipe\.store .*outside GM tensor 'C'"):
        replay(_replace(gemm(), "fixpipe.store", offset=4))


def test_a_wait_whose_flag_is_never_raised() -> None:
    program = gemm(chunks=2)
    program.add(wait_flag(0, "VECTOR", "MTE3", 7))
    with pytest.raises(CompileError, match="waits for a flag no earlier set_flag raises"):
        static_schedule(program)
    with pytest.raises(SimulationError, match=r"wait_flag VECTOR->MTE3 #7\) waits for a flag that is never raised"):
        replay(program)


def test_instructions_are_costed_from_the_machine() -> None:
    split = machine("npu-split")
    # a split machine's vector cores copy GM -> UB on their own MTE2: 8 KiB in 512-byte bursts at 128 B/cycle
    load = copy(split, 1, Region(GM, 0, 8192, "X"), Region("UB", 0, 8192))
    assert (load.opcode, load.pipe, load.cycles, load.latency) == ("mte2.copy", "MTE2", 64, 200)
    # one 256-byte repeat a cycle over the widest operand; a 64 x 64 x 64 mmad is 64 cube steps
    add = vector(split, 1, "add", Region("UB", 0, 1000), Region("UB", 1024, 1000), Region("UB", 2048, 1000))
    assert (add.opcode, add.pipe, add.cycles) == ("vec.add", "VECTOR", 4)
    product = mmad(split, 0, Region("L0A", 0, TILE), Region("L0B", 0, TILE), Region("L0C", 0, 16384), 64, 64, 64, True)
    assert product.cycles == 64 and product.reads == (Region("L0A", 0, TILE), Region("L0B", 0, TILE))
    program = Program(split)
    with pytest.raises(CompileError, match="unknown pipe 'DMA'"):
        program.add(dataclasses.replace(add, pipe="DMA"))
