"""The functional simulator: a program run on numpy copies of GM and of every core's buffers.

Each buffer holds what the instructions wrote into it, region by region: an L1
or UB patch (the GM elements a load brought, by offset), an L0A/L0B tile in
fractal order (fp16), an L0C tile (fp32 sums), a UB chunk of results.  An
instruction reads only what its source regions hold — an img2col needing an
element its patch lacks, or a vector step reading a tensor element no load
brought, is a ``SimulationError`` (a vector step's missing element reads NaN).
Instructions run in program order, an order the replay (``replay``) proves the
flags keep: each instruction's data is ready when the timed machine runs it.
The cube reads fp16 (operands rounded where MTE1 builds the fractals) and sums
in fp32, as the hardware does.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import numpy as np

from neoflow.codegen.lattice import split_epilogue
from neoflow.ir import dtypes as dt
from neoflow.ir.interpreter import evaluate_at, evaluate_op, reduction_identity
from neoflow.targets.npu import cube, vector
from neoflow.targets.npu.data import EpilogueTile, Footprint, OperandTile, OutputTile, VectorChunk
from neoflow.targets.npu.isa import Instruction, Program, Region
from neoflow.targets.npu.machine import GM
from neoflow.targets.npu.replay import SimulationError

_COMBINE = {"ReduceAdd": np.add, "ReduceMul": np.multiply, "ReduceMax": np.maximum, "ReduceMin": np.minimum}


class _Patch:
    """GM elements ``offsets`` (sorted) of ``tensor`` with their ``values``."""

    def __init__(self, footprint: Footprint, values: np.ndarray) -> None:
        self.tensor, self.offsets, self.values = footprint.tensor, footprint.offsets, values


def run_program(program: Program, gm: MutableMapping[str, np.ndarray]) -> None:
    """Run ``program`` on ``gm`` (GM tensor name -> flat array; outputs written in place)."""
    buffers: dict[tuple[int, str], dict[int, object]] = {}
    for position, instruction in enumerate(program.instructions):
        if instruction.event is not None:
            continue
        try:
            _execute(instruction, buffers, gm)
        except SimulationError as err:
            raise SimulationError(f"instruction {position} ({instruction.text()}): {err}") from None


def _load(buffers, core: int, region: Region):
    held = buffers.get((core, region.space), {}).get(region.offset)
    if held is None:
        raise SimulationError(f"reads {region}, which no instruction wrote")
    return held


def _store(buffers, core: int, region: Region, value) -> None:
    buffers.setdefault((core, region.space), {})[region.offset] = value


def _execute(instruction: Instruction, buffers, gm) -> None:
    data, core, opcode = instruction.data, instruction.core, instruction.opcode
    if isinstance(data, Footprint):  # mte2: GM -> L1 / UB
        _store(buffers, core, instruction.writes[0], _Patch(data, gm[data.tensor][data.offsets]))
    elif isinstance(data, OperandTile):  # mte1.img2col: L1 patch -> fractal tile
        patch = _load(buffers, core, instruction.reads[0])
        _store(buffers, core, instruction.writes[0], _img2col(data, patch))
    elif opcode == "cube.mmad":
        init = data[3]
        a = _load(buffers, core, instruction.reads[0])
        b = _load(buffers, core, instruction.reads[1])
        product = np.matmul(a, b.T, dtype=np.float32)
        if not init:
            product = _load(buffers, core, instruction.writes[0]) + product
        _store(buffers, core, instruction.writes[0], product)
    elif isinstance(data, OutputTile) and instruction.writes[0].space != GM:  # fixpipe: L0C rows -> UB
        first = data.rows.start - data.tile_rows.start
        sums = _load(buffers, core, instruction.reads[0])[first : first + len(data.rows)]
        _store(buffers, core, instruction.writes[0], sums)
    elif isinstance(data, OutputTile):  # fixpipe: L0C -> GM
        _fixpipe(data, _load(buffers, core, instruction.reads[0]), gm)
    elif isinstance(data, EpilogueTile):
        _epilogue(instruction, data, buffers)
    elif isinstance(data, VectorChunk):
        _vector(instruction, data, buffers, gm)
    elif opcode == "vec.dup":
        _store(buffers, core, instruction.writes[0], "zero")
    elif opcode == "mte3.copy":
        source, destination = instruction.reads[0], instruction.writes[0]
        held = _load(buffers, core, source)
        array = gm[destination.tensor]
        if isinstance(data, range):
            array[data.start : data.stop] = held
        elif isinstance(data, np.ndarray):  # an output tile's points
            array[data] = held
        else:  # zeros over a byte range
            size = array.itemsize
            array[destination.offset // size : (destination.offset + destination.size) // size] = 0
    else:
        raise SimulationError(f"the functional simulator has no meaning for '{opcode}'")


def _img2col(tile: OperandTile, patch: _Patch) -> np.ndarray:
    offsets, live = cube.operand_offsets(tile, cube.batch_env(tile.view, tile.batch))
    wanted = offsets[live]
    at = np.searchsorted(patch.offsets, wanted)
    at = np.minimum(at, max(patch.offsets.size - 1, 0))
    if wanted.size and (patch.offsets.size == 0 or (patch.offsets[at] != wanted).any()):
        missing = wanted[(patch.offsets.size == 0) | (patch.offsets[at] != wanted)][0]
        raise SimulationError(f"element {int(missing)} of '{tile.gather.tensor}' is not in the L1 patch")
    values = np.zeros(offsets.shape, np.float32)
    values[live] = patch.values[at].astype(np.float32)
    return values.astype(np.float16)  # the cube reads fp16 fractals


def _fixpipe(tile: OutputTile, sums: np.ndarray, gm) -> None:
    view = tile.view
    env, offsets = cube.output_offsets(view, tile.rows, tile.cols, tile.batch)
    if not tile.epilogue:
        if tile.accumulate:  # FIXPIPE's atomic add: the splits' partial sums meet in GM
            np.add.at(gm[tile.workspace], offsets, sums)
        else:
            gm[tile.workspace][offsets] = sums
        return
    arrays = {t.name: gm[t.name].reshape(t.shape) for t in view.op.inputs}
    result = _epilogue_value(view, env, arrays, sums)
    target = gm[view.op.name]
    target[offsets] = result.astype(target.dtype, copy=False)


def _epilogue(instruction: Instruction, tile: EpilogueTile, buffers) -> None:
    core, view = instruction.core, tile.view
    held = [_load(buffers, core, r) for r in instruction.reads]
    sums, patches = held[0], [h for h in held[1:] if isinstance(h, _Patch)]
    env, _ = cube.output_offsets(view, tile.rows, tile.cols, tile.batch)
    value = _epilogue_value(view, env, _masked(view.op, patches), sums)
    out = np.broadcast_to(np.asarray(value), sums.shape).astype(dt.numpy_dtype(view.op.dtype))
    _store(buffers, core, instruction.writes[0], out)


def _epilogue_value(view, env: dict, arrays: dict, sums: np.ndarray):
    """``view``'s epilogue (its reduction alone where it has none) at the points of ``env``, the
    reduction's value there ``sums``."""
    body = view.epilogue if view.epilogue is not None else view.reduce
    return evaluate_at(body, env, arrays, view.op.name, reduction=sums)


def _masked(op, patches: list[_Patch]) -> dict[str, np.ndarray]:
    """Each input of ``op`` as a step sees it: the elements its loads brought, NaN (0 for
    integers) elsewhere."""
    arrays = {}
    for tensor in op.inputs:
        dtype = dt.numpy_dtype(tensor.dtype)
        fill = np.nan if np.issubdtype(dtype, np.floating) else 0
        flat = np.full(tensor.size, fill, dtype=dtype)
        for patch in patches:
            if patch.tensor == tensor.name:
                flat[patch.offsets] = patch.values
        arrays[tensor.name] = flat.reshape(tensor.shape)
    return arrays


def _vector(instruction: Instruction, chunk: VectorChunk, buffers, gm) -> None:
    core, op = instruction.core, chunk.op
    held = [_load(buffers, core, r) for r in instruction.reads]
    patches = [h for h in held if isinstance(h, _Patch)]
    arrays = _masked(chunk.op, patches)
    kind = vector.mode(op, chunk.accumulator)
    points_env = vector.points_env(op, chunk.points)
    out_dtype = dt.numpy_dtype(op.dtype)
    if kind == "pointwise":
        value = evaluate_at(op.body, points_env, arrays, op.name)
    elif kind == "whole":
        value = evaluate_op(op, arrays).reshape(-1)[chunk.points.start : chunk.points.stop]
    elif kind == "epilogue":
        sums = next(p for p in patches if p.tensor == chunk.accumulator)
        value = evaluate_at(op.body, points_env, arrays, op.name, reduction=sums.values)
    else:
        reduce, epilogue = split_epilogue(op.body, op)
        env, live = vector.grid_env(op, reduce, chunk.points, chunk.terms)
        target = dt.numpy_dtype(reduce.dtype)
        terms = np.asarray(evaluate_at(reduce.body, env, arrays, op.name, live=live), dtype=target)
        shape = (len(chunk.points), len(chunk.terms))
        terms = np.broadcast_to(terms, shape)
        identity = np.asarray(reduction_identity(reduce.kind, target), dtype=target)
        terms = np.where(live, terms, identity)
        partial = _COMBINE[reduce.kind].reduce(terms, axis=1, initial=identity)
        if not chunk.first:
            partial = _COMBINE[reduce.kind](next(h for h in held if isinstance(h, np.ndarray)), partial)
        if not chunk.last:
            _store(buffers, core, instruction.writes[0], partial)
            return
        value = partial if epilogue is None else evaluate_at(epilogue, points_env, arrays, op.name, reduction=partial)
    value = np.broadcast_to(np.asarray(value), (len(chunk.points),)).astype(out_dtype)
    _store(buffers, core, instruction.writes[0], value)


__all__ = ["GM", "run_program"]
