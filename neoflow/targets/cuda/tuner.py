"""Measures the cuda target's kernel choices on the GPU (``neoflow tune --target cuda``).

``tune_op`` times the timing model's best ``CANDIDATES`` kernels of each tensor-core piece of an op
(``plan.candidates``, compiled in parallel by NVRTC), each piece alone in its op (the other pieces as
the model planned them), every candidate's output checked against the model's choice first; the
candidates take turns in blocks of CUDA-graph replays and the medians decide; the winner then races
its own tiles at half and twice its depth splits.  The fastest goes into the table (``tuning``) where
it beats the model's choice by ``MARGIN`` (``BESIDE_MARGIN`` for an op timed in its graph).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial

import numpy as np

from neoflow.codegen.hardware import TENSOR_CORE
from neoflow.codegen.implicit_gemm import gemm_views
from neoflow.fusion.work import op_work
from neoflow.ir import dtypes as dt
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op
from neoflow.targets.cache import read_table, within_budget
from neoflow.targets.cuda.concurrency import ops_beside_others
from neoflow.targets.cuda.emit import module_source
from neoflow.targets.cuda.executor import CudaExecutor
from neoflow.targets.cuda.nvrtc import compile_cubin
from neoflow.targets.cuda.plan import (
    TUNER_TILES,
    MmaKernel,
    OpPlan,
    candidates,
    producer_twin,
    tensor_core_plan,
)
from neoflow.targets.cuda.timing import predict_kernel
from neoflow.targets.cuda.tuning import piece_key, record, table_path

#: the timing model's best candidates of a piece that are timed
CANDIDATES = 12
#: a candidate must be this much faster than the model's choice to replace it (alone, in an op of its own:
#: within a graph, where independent ops share the GPU, gains of 3 % measured alone came out as losses)
MARGIN = 0.95
#: in its graph (``tune_beside``) a kernel replaces the incumbent when this much faster: measured where it
#: runs, the block medians of capsule28's step varied by 0.2-0.5 %, and at ``MARGIN`` a 3.4 % gain (its
#: second weight gradient at 8 depth splits rather than 16: 166.4 -> 160.8 us) was left out
BESIDE_MARGIN = 0.98
#: times at most a race's winner races its own tiles at half and twice its depth splits (``neighbours``)
REFINE_ROUNDS = 2
#: replays of a candidate's CUDA graph a block, and blocks (the candidates take turns block by block)
REPLAYS, ROUNDS = 10, 5


@dataclass(frozen=True)
class PieceResult:
    """What tuning one piece found: the model's choice and the fastest, with their median seconds."""

    op: str
    piece: int
    key: str
    chosen: object
    fastest: object
    chosen_seconds: float
    fastest_seconds: float
    tried: int
    rejected: tuple[str, ...] = ()


def describe(kernel) -> str:
    """A kernel's instruction, tiles and splits in a few characters."""
    t = kernel.tiles
    instruction = "wgmma" if kernel.wgmma else "mma"
    sliced = f"x{t.warps_k}" if t.warps_k > 1 else ""
    producer = " producer" if kernel.specialized else ""
    warps = f"{t.warps_m}x{t.warps_n}{sliced}{producer}"
    return f"{instruction} {t.block_m}x{t.block_n}x{t.block_k}/{warps} s{kernel.splits}"


def _inputs(op: Op, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {t.name: rng.standard_normal(t.shape).astype(dt.numpy_dtype(t.dtype)) for t in op.inputs}


def _close(expected: np.ndarray, found: np.ndarray) -> bool:
    expected, found = expected.astype(np.float32), found.astype(np.float32)
    scale = float(np.max(np.abs(expected))) if expected.size else 1.0
    return bool(np.allclose(found, expected, rtol=2e-2, atol=2e-2 * max(scale, 1e-6), equal_nan=True))


def tune_op(op: Op, precision: str, arch: str, deadline: float | None = None, seed: int = 0) -> list[PieceResult]:
    """Time the timing model's best ``CANDIDATES`` kernels of each tensor-core piece of ``op`` on the
    GPU (compiled in parallel by NVRTC) and return, per piece, the model's choice and the fastest."""
    planned = tensor_core_plan(op, "nf_op0", precision, arch, use_table=False)
    if planned is None:
        return []
    inputs = _inputs(op, seed)
    graph = Graph.from_ops([op])
    results = []
    for piece, view in enumerate(gemm_views(op, TENSOR_CORE)):
        if deadline is not None and time.perf_counter() > deadline:
            break
        chosen = planned.kernels[piece]
        trial = _trial(chosen, view, precision, arch, predict_kernel)
        variant_of = partial(_alone, planned, piece)
        found = _search(trial, variant_of, graph, [op.name], inputs, precision, arch)
        key = piece_key(op, piece, precision, arch)
        results.append(PieceResult(op.name, piece, key, chosen, *found))
    return results


def _alone(planned: OpPlan, piece: int, kernel) -> list[OpPlan]:
    """The plans of an op's graph of its own with piece ``piece``'s kernel swapped for ``kernel``."""
    return [_swapped(planned, piece, kernel)]


def _in_graph(plans: Sequence[OpPlan], position: int, piece: int, kernel) -> list[OpPlan]:
    """A graph's ``plans`` with piece ``piece`` of the op at ``position`` swapped for ``kernel``."""
    return [*plans[:position], _swapped(plans[position], piece, kernel), *plans[position + 1 :]]


def _swapped(planned: OpPlan, piece: int, kernel) -> OpPlan:
    """``planned`` with the kernel of piece ``piece`` swapped for ``kernel``."""
    return OpPlan(planned.op, (*planned.kernels[:piece], kernel, *planned.kernels[piece + 1 :]), planned.zero_first)


def neighbours(kernel: MmaKernel, precision: str, arch: str) -> list[MmaKernel]:
    """``kernel`` at half and at twice its depth splits, everything else the same, where those are
    candidates (``candidates``, the tuner's: its depth tiles allow them)."""
    wanted = {kernel.splits // 2, kernel.splits * 2} - {0}
    return [
        k
        for k in candidates(kernel.name, kernel.view, precision, arch, tuner=True)
        if k.splits in wanted and dataclasses.replace(k, splits=kernel.splits) == kernel
    ]


def _search(
    trial: list,
    variant_of: Callable[[MmaKernel], list],
    graph: Graph,
    keep,
    feed,
    precision: str,
    arch: str,
    margin: float = MARGIN,
) -> tuple:
    """``_race`` of ``trial`` (``variant_of(kernel)``: the graph's plans with it), then up to
    ``REFINE_ROUNDS`` races of the winner against its ``neighbours`` not yet tried (a model's
    ranking rarely puts the best depth split of the fastest tiles among the few it offers): what
    ``_race`` returns, a later winner's seconds scaled by its race's incumbent's (one yardstick)."""
    best, first_seconds, best_seconds, tried, rejected = _race(
        trial, [variant_of(k) for k in trial], graph, keep, feed, precision, arch, margin
    )
    seen = list(trial)
    for _ in range(REFINE_ROUNDS):
        near = [k for k in neighbours(best, precision, arch) if k not in seen]
        if not near:
            break
        seen += near
        race = [best, *near]
        winner, incumbent_seconds, winner_seconds, _, refused = _race(
            race, [variant_of(k) for k in race], graph, keep, feed, precision, arch, margin
        )
        tried, rejected = tried + len(near), rejected + refused
        if winner == best:
            break
        best, best_seconds = winner, best_seconds * winner_seconds / incumbent_seconds
    return best, first_seconds, best_seconds, tried, rejected


def _race(
    trial: list, variants: list, graph: Graph, keep, feed, precision: str, arch: str, margin: float = MARGIN
) -> tuple:
    """Run ``graph`` with each of ``variants`` (its plans, one for each kernel of ``trial``; compiled in
    parallel by NVRTC) on ``feed``, the kept tensors checked against the first's, and time the CUDA
    graphs of those that agree in turns: ``(fastest kernel, the first's seconds, the fastest's
    seconds, kernels tried, those rejected)``, the first (the model's choice) kept unless another
    beats it by ``margin``.  A kernel that spills registers under this NVRTC is not timed (rejected,
    saying so): the 80 x 128 layout spilled 20 bytes for sm_80 under the H200 host's NVRTC, none
    under the wheel's."""
    with ProcessPoolExecutor(max(1, min(len(variants), os.cpu_count() or 1))) as pool:
        cubins = list(pool.map(compile_cubin, [module_source(v) for v in variants], [arch] * len(variants)))
    executors, kept, rejected, expected = [], [], [], None
    for position, (kernel, variant, cubin) in enumerate(zip(trial, variants, cubins, strict=True)):
        if position and cubin.spills.get(kernel.name):
            rejected.append(f"{describe(kernel)} (spills {cubin.spills[kernel.name]} bytes)")
            continue  # the incumbent is kept whatever it does: something must run
        executor = CudaExecutor(graph, keep, precision=precision, arch=arch, plans=variant)
        found = executor.run(feed)
        if expected is None:
            expected = found
        elif not all(_close(expected[name], found[name]) for name in expected):
            rejected.append(describe(kernel))
            continue
        executors.append(executor)
        kept.append(kernel)
    seconds = time_in_turns([executor.replay_graph for executor in executors])
    best = min(range(len(kept)), key=seconds.__getitem__)
    if seconds[best] >= margin * seconds[0]:
        best = 0
    return kept[best], seconds[0], seconds[best], len(trial), tuple(rejected)


def _trial(chosen, view, precision: str, arch: str, predict) -> list:
    """The kernels of a piece the tuner times: the model's ``chosen`` one, the model's best other
    candidates (``predict``), the warp layouts the model cannot rank at the chosen depth splits, and
    every one's warp-specialised twin (which the model does not rank either)."""
    ranked = sorted(candidates(chosen.name, view, precision, arch), key=predict)
    trial = [chosen, *[k for k in ranked if k != chosen][: CANDIDATES - 1]]
    trial += [
        k
        for k in candidates(chosen.name, view, precision, arch, tuner=True)
        if k.splits == chosen.splits and k.tiles in TUNER_TILES and not k.specialized and k not in trial
    ]
    return trial + [twin for twin in map(producer_twin, trial) if twin is not None and twin not in trial]


def tune_beside(
    graph: Graph,
    keep,
    feed,
    precision: str,
    arch: str,
    deadline: float | None = None,
    only: Collection[str] | None = None,
) -> list[PieceResult]:
    """Time the tensor-core pieces of the ops of ``graph`` that run beside other work
    (``ops_beside_others``: alone they would not say how they run there) where they run: the whole
    graph's CUDA graph replayed on ``feed`` with each of a piece's ``_trial`` kernels in turn (the rest
    as planned), the kept tensors checked against the model's choice's first; the fastest recorded
    under the piece's ``beside`` key, which plans for such an op read.  ``only`` names the ops to
    tune, of those (all of them by default)."""
    from neoflow.targets.cuda.executor import graph_plans

    beside = ops_beside_others(graph)
    if only is not None:
        beside &= set(only)
    plans = graph_plans(graph, precision, arch)
    results = []
    for position, planned in enumerate(plans):
        if planned.op.name not in beside:
            continue
        for piece, chosen in enumerate(planned.kernels):
            if deadline is not None and time.perf_counter() > deadline:
                return results
            if not isinstance(chosen, MmaKernel):
                continue  # a SIMT kernel: nothing to choose
            trial = _trial(chosen, chosen.view, precision, arch, lambda k: predict_kernel(k, beside=True))
            variant_of = partial(_in_graph, plans, position, piece)
            found = _search(trial, variant_of, graph, keep, feed, precision, arch, BESIDE_MARGIN)
            key = piece_key(planned.op, piece, precision, arch, beside=True)
            results.append(PieceResult(planned.op.name, piece, key, chosen, *found))
            record(results[-1:], arch)
    return results


def time_in_turns(graphs: Sequence, rounds: int = ROUNDS) -> list[float]:
    """Median seconds of a replay of each CUDA graph, the graphs taking turns in blocks of replays."""
    from neoflow.targets.cuda import driver

    times: list[list[float]] = [[] for _ in graphs]
    for _ in range(rounds):
        for graph, found in zip(graphs, times, strict=True):
            found.extend(driver.time_replays(graph, REPLAYS))
    return [statistics.median(found) for found in times]


def tensor_core_ops(graph: Graph, precision: str, arch: str) -> list[Op]:
    """The ops of ``graph`` with pieces on the tensor cores, the most arithmetic first; not those
    running beside other work (``concurrency.ops_beside_others``), planned for that without the
    table, whose kernels timed alone would not say how they run in the graph."""
    beside = ops_beside_others(graph)
    ops = [
        op
        for op in graph.ops
        if op.name not in beside and tensor_core_plan(op, "nf_op0", precision, arch, use_table=False) is not None
    ]
    return sorted(ops, key=lambda op: -op_work(op).flops)


def tune_ops(
    ops: Sequence[Op],
    precision: str,
    arch: str,
    budget_seconds: float,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[PieceResult]:
    """Tune the tensor-core pieces of ``ops`` in order within ``budget_seconds``, recording as it goes."""
    deadline = time.perf_counter() + budget_seconds
    found: list[PieceResult] = []
    for op in within_budget(ops, deadline, progress):
        results = tune_op(op, precision, arch, deadline)
        record(results, arch)
        found.extend(results)
    return found


def tune_graph(
    executor: CudaExecutor,
    feed,
    ops: Sequence[Op],
    budget_seconds: float,
    progress: Callable[[int, int, str], None] | None = None,
) -> list[PieceResult]:
    """Tune ``ops`` (of ``executor``'s graph: ``tensor_core_ops``, or those of them still to tune)
    alone, then, with the time left of ``budget_seconds``, the ops beside other work where they run
    (``tune_beside``: the whole graph replayed on ``feed``)."""
    deadline = time.perf_counter() + budget_seconds
    precision, arch = executor.precision, executor.arch
    results = tune_ops(ops, precision, arch, budget_seconds, progress)
    return results + tune_beside(executor.graph, executor.keep, feed, precision, arch, deadline)


def tuned_pieces(op: Op, precision: str, arch: str) -> bool:
    """Whether every tensor-core piece of ``op`` has an entry."""
    views = gemm_views(op, TENSOR_CORE) or []
    table = read_table(table_path(arch))
    return bool(views) and all(piece_key(op, k, precision, arch) in table for k in range(len(views)))
