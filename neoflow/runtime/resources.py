"""Resource guards: a model whose tensors cannot fit this machine fails before anything is allocated."""

from __future__ import annotations

import math
import os
from functools import cache

from neoflow.errors import InputError
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph


@cache
def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(graph: Graph, limit: int | None = None) -> None:
    """Raise ``InputError`` naming the first tensor of ``graph`` (an input or an op's output) that
    alone needs more than ``limit`` bytes (default: this machine's memory)."""
    limit = machine_memory() if limit is None else limit
    if limit is None:
        return
    public = graph.source_names
    for tensor in (*graph.inputs, *(op.output for op in graph.ops)):
        need = math.prod(tensor.shape) * dt.numpy_dtype(tensor.dtype).itemsize
        if need > limit:
            raise InputError(
                f"tensor '{public.get(tensor.name, tensor.name)}' ({list(tensor.shape)} {tensor.dtype}) needs "
                f"{need / 2**30:.1f} GiB, more than this machine's {limit / 2**30:.1f} GiB of memory"
            )
