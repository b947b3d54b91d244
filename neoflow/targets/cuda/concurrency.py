"""Which kernels of a graph may run at once on the GPU, and on which stream each runs.

A graph's ops run as *tasks*: an op's memset (its output zeroed first), then
each of its kernels (a dense piece, with the finishing kernel of a split depth).  An
op must follow every earlier op that writes device memory it reads or writes, or reads
memory it writes — through the tensors themselves and through the arena places the
memory plan lets later tensors reuse.  Ops with no such path between them (a layer's
input and weight gradients, the forward conv and both adjoints of a custom op) run at
once, on separate streams (*lanes*); inside a stream capture the lanes' event waits
become the CUDA graph's edges.  An op's pieces write disjoint points, so they run at
once too.  Nothing here touches the GPU: the executor turns a ``Schedule`` into
launches, and the tests check it on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from neoflow.ir.graph import Graph
from neoflow.targets.cuda.plan import OpPlan
from neoflow.targets.memory import nbytes

#: device memory ``[start, end)`` (addresses)
Region = tuple[int, int]

#: streams a graph's tasks spread over at most (each one a CUDA stream)
MAX_LANES = 8


def ops_beside_others(graph: Graph) -> set[str]:
    """The ops of ``graph`` whose kernels run beside other work: those no op reads (they end their
    chain: a weight's update) on a chain of ops shorter than the graph's longest, which runs on
    after them.  Their kernels are planned for the GPU's time they take, not their own: other work
    fills a wave they leave part empty (capsule28's second weight gradient ran the step in
    0.2011 ms with 8 depth splits, 0.2073 with the 32 it took alone, 0.2115 with 64, on an H200)."""
    depth: dict[str, int] = {}  # the most ops on a chain from the graph's inputs to each op, itself included
    for op in graph.ops:
        depth[op.name] = 1 + max((depth[t.name] for t in op.inputs if t.name in depth), default=0)
    height = dict.fromkeys(depth, 1)  # ... and from each op on to the end
    for op in reversed(graph.ops):
        for tensor in op.inputs:
            if tensor.name in height:
                height[tensor.name] = max(height[tensor.name], height[op.name] + 1)
    longest = max((depth[name] + height[name] - 1 for name in depth), default=0)
    return {name for name in depth if height[name] == 1 and depth[name] < longest}


def _overlaps(first: Sequence[Region], second: Sequence[Region]) -> bool:
    return any(a < d and c < b for a, b in first for c, d in second)


def op_dependencies(reads: Sequence[Sequence[Region]], writes: Sequence[Sequence[Region]]) -> list[set[int]]:
    """For op ``k`` (its ``reads[k]`` and ``writes[k]``, in the graph's order), the earlier ops it
    must follow: those writing memory it reads or writes, and those reading memory it writes."""
    depends: list[set[int]] = []
    for k in range(len(reads)):
        depends.append(
            {
                j
                for j in range(k)
                if _overlaps(writes[j], reads[k]) or _overlaps(writes[j], writes[k]) or _overlaps(reads[j], writes[k])
            }
        )
    return depends


@dataclass(frozen=True)
class Task:
    """Op ``op``'s memset (``piece`` None) or its ``piece``-th kernel."""

    op: int
    piece: int | None


@dataclass(frozen=True)
class Schedule:
    """Per task (in launch order): its ``lanes`` (0 is the capturing stream), the earlier tasks on
    other lanes it ``waits`` for, and every earlier task it ``follows`` (its dependencies, whatever
    their lane); ``lane_count`` lanes in all."""

    tasks: tuple[Task, ...]
    lanes: tuple[int, ...]
    waits: tuple[tuple[int, ...], ...]
    lane_count: int
    follows: tuple[tuple[int, ...], ...]

    def urgency(self, levels: int) -> tuple[int, ...]:
        """Per task, how urgent it is, from 0 to ``levels - 1`` (most): one less than the most tasks on a
        chain of dependencies from it to the end of the run (itself included), at most ``levels - 1``
        (a critical-path list schedule's priority; chains longer than the levels tie, which matters
        only where two long chains run at once).  When tasks that may run at once share the GPU,
        the urgent ones' blocks start first: the input-gradient chain of a backward pass before the
        weight gradients beside it, which end their chains (capsule28: the first layer's input
        gradient, then its weight gradient, ahead of the second layer's weight gradient).  Counted
        in tasks, not predicted seconds: the timing model errs by more than the chains' lengths
        differ."""
        remaining = [1] * len(self.tasks)
        for task in reversed(range(len(self.tasks))):
            for before in self.follows[task]:
                remaining[before] = max(remaining[before], remaining[task] + 1)
        return tuple(min(levels, length) - 1 for length in remaining)


def schedule(
    pieces: Sequence[int],
    memsets: Sequence[set[int] | None],
    depends: Sequence[set[int]],
    max_lanes: int = MAX_LANES,
) -> Schedule:
    """The tasks of ops with ``pieces[k]`` kernels following ``depends`` (``op_dependencies``), on
    at most ``max_lanes`` lanes.  ``memsets[k]``: None where op ``k`` zeroes nothing first, else the
    earlier ops its memset must follow (those using the memory it zeroes).  A memset that follows
    nothing is launched first, at the start of the run, out of the way of the chain it feeds (a
    memset node ahead of a kernel cost about 6 us on an H200); the op's kernels follow it and the
    op's dependencies.  A task continues the lane of the latest task it follows where that task is
    its lane's last, else takes an unused lane, else the lane idle the longest (an order the
    dependencies do not need costs only time)."""
    tasks: list[Task] = []
    follows: list[list[int]] = []  # per task, the tasks it must follow
    zeroed: dict[int, int] = {}  # op -> its memset task
    for k, after in enumerate(memsets):
        if after is not None and not after:
            zeroed[k] = len(tasks)
            tasks.append(Task(k, None))
            follows.append([])
    last_of_op: dict[int, list[int]] = {}
    for k, count in enumerate(pieces):
        before = sorted(t for j in depends[k] for t in last_of_op[j])
        after = memsets[k]
        if after and k not in zeroed:
            zeroed[k] = len(tasks)
            tasks.append(Task(k, None))
            follows.append(sorted(t for j in after for t in last_of_op[j]))
        first = [zeroed[k]] if k in zeroed else []
        ends = []
        for piece in range(count):
            tasks.append(Task(k, piece))
            follows.append(sorted({*first, *before}))
            ends.append(len(tasks) - 1)
        last_of_op[k] = ends or first
    lanes: list[int] = []
    tails: list[int] = []  # per lane, its last task
    waits: list[tuple[int, ...]] = []
    for t, needed in enumerate(follows):
        continuing = [lane for lane, tail in enumerate(tails) if tail in needed]
        if continuing:
            lane = max(continuing, key=lambda lane: tails[lane])
        elif len(tails) < max_lanes:
            lane = len(tails)
            tails.append(-1)
        else:
            lane = min(range(len(tails)), key=lambda lane: tails[lane])
        lanes.append(lane)
        waits.append(tuple(d for d in needed if lanes[d] != lane))
        tails[lane] = t
    return Schedule(
        tuple(tasks), tuple(lanes), tuple(waits), max(len(tails), 1), tuple(tuple(needed) for needed in follows)
    )


def plan_regions(
    plans: Sequence[OpPlan], address: Callable[[str], int], workspaces: Mapping[str, int]
) -> tuple[list[list[Region]], list[list[Region]]]:
    """Per op of ``plans``: the device memory it reads (its inputs) and writes (its output, and its
    float32 workspace where its depth is split), tensor ``name`` at ``address(name)``, op ``name``'s
    workspace at ``workspaces[name]``."""
    reads = [[(address(t.name), address(t.name) + nbytes(t)) for t in plan.op.inputs] for plan in plans]
    writes = []
    for plan in plans:
        out = address(plan.op.name)
        written = [(out, out + nbytes(plan.op.output))]
        if plan.op.name in workspaces:
            start = workspaces[plan.op.name]
            written.append((start, start + plan.op.output.size * 4))
        writes.append(written)
    return reads, writes


def plan_schedule(
    plans: Sequence[OpPlan], address: Callable[[str], int], workspaces: Mapping[str, int], max_lanes: int = MAX_LANES
) -> Schedule:
    """The ``schedule`` of ``plans`` (in the graph's order) whose tensors and workspaces lie where
    ``plan_regions`` says."""
    reads, writes = plan_regions(plans, address, workspaces)
    # per op, the memory its memset zeroes: its output where it must be zeroed first (a workspace
    # is left zeroed by the split kernel's finishing kernels, ready for the next run)
    zeroes = [[written[0]] if plan.zero_first else [] for plan, written in zip(plans, writes, strict=True)]
    memsets = memset_dependencies(zeroes, reads, writes)
    return schedule([len(plan.kernels) for plan in plans], memsets, op_dependencies(reads, writes), max_lanes)


def memset_dependencies(
    zeroes: Sequence[Sequence[Region]], reads: Sequence[Sequence[Region]], writes: Sequence[Sequence[Region]]
) -> list[set[int] | None]:
    """For op ``k`` whose memset zeroes ``zeroes[k]`` (empty: it has none), the earlier ops that
    memset must follow: those reading or writing that memory (``schedule``'s ``memsets``)."""
    return [
        {j for j in range(k) if _overlaps(zero, reads[j]) or _overlaps(zero, writes[j])} if zero else None
        for k, zero in enumerate(zeroes)
    ]
