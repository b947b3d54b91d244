"""Resource guards: a model or op whose tensors cannot fit this machine, or whose arithmetic cannot finish
within the time limit even at a rate no machine of its target reaches, fails before anything is allocated
or run, naming the tensor or op."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from functools import cache

import numpy as np

from neoflow.errors import InputError, ResourceError
from neoflow.fusion.work import op_work
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import evaluate as interpret
from neoflow.ir.op import Op

#: arithmetic per second (flops, as ``fusion.work`` counts them) above what each target reaches on any
#: machine: NumPy on one host, C on a large server, a GPU's tensor cores; work estimated past the limit at
#: this rate cannot finish within it (the NPU and tensor-core models, which simulate, are not guarded)
OPTIMISTIC_FLOPS = {"interp": 5e10, "cpu": 5e12, "cuda": 2e15}
#: a rate (flop/s) so slow that work needing more than the time limit at it asks for this machine's own
#: measured FMA peak, which no kernel beats
SLOW_MACHINE_FLOPS = 1e10
#: the time limit, seconds, unless ``NEOFLOW_TIME_LIMIT`` says otherwise (0: no limit)
DEFAULT_TIME_LIMIT = 600.0


@cache
def machine_memory() -> int | None:
    """This machine's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_resources(graph: Graph, target: str, measured_peak: Callable[[], float | None] | None = None) -> None:
    """Both guards on ``graph`` compiled for ``target``: its memory, then its work (``check_work``)."""
    check_memory(graph)
    check_work(graph, target, measured_peak=measured_peak)


def check_memory(graph: Graph, limit: int | None = None) -> None:
    """Raise ``ResourceError`` naming the first tensor of ``graph`` (an input or an op's output) that
    alone needs more than ``limit`` bytes (default: this machine's memory)."""
    limit = machine_memory() if limit is None else limit
    if limit is None:
        return
    public = graph.source_names
    for tensor in (*graph.inputs, *(op.output for op in graph.ops)):
        need = math.prod(tensor.shape) * dt.numpy_dtype(tensor.dtype).itemsize
        if need > limit:
            raise ResourceError(
                f"tensor '{public.get(tensor.name, tensor.name)}' ({list(tensor.shape)} {tensor.dtype}) needs "
                f"{need / 2**30:.1f} GiB, more than this machine's {limit / 2**30:.1f} GiB of memory"
            )


def time_limit() -> float:
    """The time limit of one run of a graph, in seconds (``NEOFLOW_TIME_LIMIT``; 0 or less: none)."""
    given = os.environ.get("NEOFLOW_TIME_LIMIT")
    if not given:
        return DEFAULT_TIME_LIMIT
    try:
        return float(given)
    except ValueError:
        raise InputError(f"NEOFLOW_TIME_LIMIT must be a number of seconds, got '{given}'") from None


def check_work(
    graph: Graph, target: str, limit: float | None = None, measured_peak: Callable[[], float | None] | None = None
) -> None:
    """Raise ``ResourceError`` naming the op of ``graph`` with the most arithmetic where the graph's
    arithmetic would take longer than ``limit`` seconds (default ``time_limit()``) at the rate
    ``OPTIMISTIC_FLOPS`` gives ``target`` or, for work that large, at ``measured_peak()`` (this
    machine's measured FMA peak, None where not measured)."""
    limit = time_limit() if limit is None else limit
    rate = OPTIMISTIC_FLOPS.get(target.split(":")[0])
    if rate is None or limit <= 0 or not graph.ops:
        return
    flops = {op.name: op_work(op).flops for op in graph.ops}
    total = sum(flops.values())
    if total / rate <= limit and measured_peak is not None and total > limit * SLOW_MACHINE_FLOPS:
        peak = measured_peak()  # measured only for work that could be too much for a slow machine
        rate = rate if peak is None else min(rate, peak)
    if total / rate > limit:
        heaviest = max(flops, key=flops.__getitem__)
        name = graph.source_names.get(heaviest, heaviest)
        raise ResourceError(
            f"op '{name}' alone does {flops[heaviest]:.2g} operations ({total:.2g} in all): at least "
            f"{total / rate / 60:.0f} minutes on target {target} here, past the time limit of {limit:.0f} s "
            "(NEOFLOW_TIME_LIMIT=seconds raises it; 0 lifts it)"
        )


def evaluate(program: Op | Graph, inputs: Mapping[str, np.ndarray]) -> np.ndarray | dict[str, np.ndarray]:
    """Evaluate an op (its output array) or a graph (a dict of outputs) with the interpreter, after
    the resource guards (``neoflow.evaluate``)."""
    check_resources(program if isinstance(program, Graph) else Graph.from_ops([program]), "interp")
    return interpret(program, inputs)
