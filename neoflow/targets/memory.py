"""Liveness-based memory planning for a graph run in op order.

Parameters and optimizer state live for the whole run; inputs live until
their last use; every other tensor lives from the op that defines it to its
last reader (or to the end if the caller wants it back).  The plan lists
which tensors die after each op, the peak of live bytes, and offsets of the
intermediates in one arena (greedy best-offset packing by size, the usual
static planner), against the naive total of giving every tensor its own buffer.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.op import Tensor

ALIGNMENT = 64  # bytes; arena offsets suit aligned vector loads


def nbytes(tensor: Tensor) -> int:
    """Bytes a dense buffer for ``tensor`` takes."""
    return tensor.size * dt.numpy_dtype(tensor.dtype).itemsize


def aligned_size(size: int) -> int:
    """``size`` bytes rounded up to a multiple of ``ALIGNMENT``."""
    return -(-size // ALIGNMENT) * ALIGNMENT


def aligned_buffer(size: int) -> tuple[np.ndarray, int]:
    """A new byte buffer of ``size`` starting at an ``ALIGNMENT``-aligned address, and that address."""
    raw = np.empty(size + ALIGNMENT, dtype=np.uint8)
    start = raw.ctypes.data
    shift = (-start) % ALIGNMENT
    return raw[shift : shift + size], start + shift


@dataclass(frozen=True)
class MemoryPlan:
    """When each tensor dies and how much memory a run needs.

    ``free_after[k]`` are the tensors whose last use is op ``k``;
    ``peak_bytes`` is the most bytes live at once (persistent tensors
    included); ``naive_bytes`` the sum over all tensors; ``arena_bytes`` the
    size of one buffer holding every intermediate at its ``offsets``."""

    free_after: tuple[tuple[str, ...], ...]
    peak_bytes: int
    naive_bytes: int
    persistent_bytes: int
    arena_bytes: int
    offsets: dict[str, int]

    def summary(self) -> str:
        """One line: peak live against naive total, and the arena size."""
        saving = 1 - self.peak_bytes / self.naive_bytes if self.naive_bytes else 0.0
        return (
            f"peak live memory {_size(self.peak_bytes)} vs naive {_size(self.naive_bytes)} "
            f"({saving:.0%} less; parameters and state {_size(self.persistent_bytes)}, "
            f"intermediates packed in an arena of {_size(self.arena_bytes)})"
        )


def _size(count: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def plan_memory(
    graph: Graph, keep: Collection[str], together: Collection[Collection[str]] = (), unstored: Collection[str] = ()
) -> MemoryPlan:
    """Plan a run of ``graph``'s ops in order, handing back the tensors in ``keep``.
    Each group of consecutive ops in ``together`` runs as one kernel: their
    outputs live from the first of them and what any of them reads until the last.
    The ``unstored`` tensors never reach memory (a kernel keeps them in a buffer of its own)."""
    tensors = graph.tensors
    persistent = set(graph.parameters)
    position = {op.name: k for k, op in enumerate(graph.ops)}
    reads_until = dict(position)
    for group in together:
        start, stop = min(position[n] for n in group), max(position[n] for n in group)
        for name in group:
            position[name], reads_until[name] = start, stop
    end = len(graph.ops)
    last_use: dict[str, int] = {}
    for k, op in enumerate(graph.ops):
        for name in op.input_names:
            last_use[name] = max(last_use.get(name, k), reads_until[op.name])
    born = {t.name: -1 for t in graph.inputs}
    born.update(position)
    lifetime = {}
    for name in born:
        if name in persistent or name in unstored:
            continue
        death = end if name in keep else last_use.get(name, born[name])
        lifetime[name] = (born[name], death)
    free_after: list[list[str]] = [[] for _ in graph.ops]
    for name, (_, death) in lifetime.items():
        if 0 <= death < end:
            free_after[death].append(name)
    persistent_bytes = sum(nbytes(tensors[name]) for name in persistent)
    live = [persistent_bytes] * max(end, 1)
    for name, (start, death) in lifetime.items():
        for k in range(max(start, 0), min(death, end - 1) + 1):
            live[k] += nbytes(tensors[name])
    intermediates = {name: span for name, span in lifetime.items() if span[0] >= 0}
    offsets, arena = _pack(intermediates, {name: nbytes(tensors[name]) for name in intermediates})
    return MemoryPlan(
        free_after=tuple(tuple(names) for names in free_after),
        peak_bytes=max(live),
        naive_bytes=sum(nbytes(t) for t in tensors.values()),
        persistent_bytes=persistent_bytes,
        arena_bytes=arena,
        offsets=offsets,
    )


def _pack(lifetimes: dict[str, tuple[int, int]], sizes: dict[str, int]) -> tuple[dict[str, int], int]:
    """Offsets for buffers so that no two that are live at once overlap; the
    largest are placed first, each at the lowest offset that fits."""
    placed: list[tuple[int, int, int, int]] = []  # offset, size, start, death
    offsets: dict[str, int] = {}
    for name in sorted(lifetimes, key=lambda n: (-sizes[n], lifetimes[n])):
        start, death = lifetimes[name]
        size = aligned_size(sizes[name])
        busy = sorted((o, o + s) for o, s, b, d in placed if b <= death and start <= d)
        offset = 0
        for low, high in busy:
            if offset + size <= low:
                break
            offset = max(offset, high)
        offsets[name] = offset
        placed.append((offset, size, start, death))
    return offsets, max((o + s for o, s, _, _ in placed), default=0)
