"""The cuda target's table of measured kernel choices (``tuner`` fills it on a GPU; ``plan`` reads it).

Without an entry the timing model (``timing.predict_kernel``) picks each contraction piece's kernel
among the candidates (``plan.candidates``); with one, the plan takes the candidate it records (its
instruction, block tiles and depth splits).  A piece is named by its op (shapes, index maps,
expression; not its name), its position among the op's pieces, the precision and the GPU architecture;
the results live in ``$NEOFLOW_CACHE_DIR/tuning/cuda-<arch>.json``.  ``NEOFLOW_TUNING=0`` ignores them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from neoflow.ir.op import Op
from neoflow.targets.cache import cache_dir, read_table, tuning_enabled, update_table

#: bump when the meaning of an entry changes: older tables are then ignored
TUNING_VERSION = 3


def table_path(arch: str) -> Path:
    """Where the results for GPUs of ``arch`` are kept."""
    return cache_dir() / "tuning" / f"cuda-{arch}.json"


def piece_key(op: Op, piece: int, precision: str, arch: str, beside: bool = False) -> str:
    """The key of piece ``piece`` of ``op``: its output's shape and dtype, indices, expression and
    inputs (not its name), the precision and the architecture; ``beside``: measured where it runs
    beside other work of its graph (``tuner.tune_beside``), not alone."""
    text = repr((TUNING_VERSION, op.output.shape, op.dtype, op.indices, op.body, op.inputs, op.ranges))
    where = "/beside" if beside else ""
    return hashlib.sha256(f"{text}/{piece}/{precision}/{arch}{where}".encode()).hexdigest()[:32]


def kernel_entry(kernel) -> dict:
    """What a table records of a chosen ``MmaKernel``: its instruction, tiles, producer and splits."""
    tiles = kernel.tiles
    return {
        "tiles": [tiles.block_m, tiles.block_n, tiles.block_k, tiles.warps_m, tiles.warps_n, tiles.warps_k],
        "wgmma": kernel.wgmma,
        "specialized": kernel.specialized,
        "splits": kernel.splits,
    }


def matches(kernel, entry: dict) -> bool:
    """Whether ``kernel`` is the one ``entry`` records."""
    recorded = kernel_entry(kernel)
    try:
        return recorded == {key: entry[key] for key in recorded}
    except (KeyError, TypeError):
        return False


def measured(op: Op, piece: int, precision: str, arch: str, beside: bool = False) -> dict | None:
    """The table's entry for a piece (``beside``: its entry measured beside other work; None where
    there is none or tuning is off)."""
    if not tuning_enabled():
        return None
    return read_table(table_path(arch)).get(piece_key(op, piece, precision, arch, beside))


def record(results: Sequence, arch: str) -> Path:
    """Add the fastest kernel of each of ``results`` (``tuner.PieceResult``) to the table of ``arch``."""
    path = table_path(arch)
    entries = {
        r.key: {
            **kernel_entry(r.fastest),
            "op": r.op,
            "piece": r.piece,
            "seconds": r.fastest_seconds,
            "model_seconds": r.chosen_seconds,
        }
        for r in results
    }
    update_table(path, entries)
    return path
