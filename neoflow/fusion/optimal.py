"""The exact baseline policy ``optimal``: the cheapest partition of a graph's ops into kernels under
the cost model, by an integer program.

Every candidate kernel is a connected group of ops (producer and reader, or two readers of one
tensor) that no path leaves and re-enters (otherwise no order runs it), priced by the cost model
as the kernel it makes in any partition (``Grouping.kernel_alone``: the same stored, inlined and
buffered decisions every policy's plan gets).  A set-partitioning program picks the candidates
covering each op exactly once at the least predicted time (scipy's ``milp``, the HiGHS solver);
a choice whose kernels depend on each other in a cycle is cut off and the program solved again.
On a graph of at most ``EXHAUSTIVE_OPS`` ops every connected group is a candidate, so the answer
is the optimum over all partitions into kernels; on a larger one, groups of up to ``max_size`` ops
and every kernel a built-in heuristic forms.  The heuristics' own plans are also priced: where one
recomputes an op in several kernels or slices a kernel (moves outside partitions) and so costs
less than the partition optimum, that plan is returned and the notes say so.  A time limit stops
the solver early with the best plan found and the proven lower bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from neoflow.errors import CompileError
from neoflow.fusion.cost import CostModel
from neoflow.fusion.plan import FusionPlan, Grouping, plan_from_groups
from neoflow.fusion.policies import BUILT_IN, FusionPolicy, faster_sliced
from neoflow.ir.graph import Graph

#: a graph this small gets every connected group of its ops as a candidate (an exhaustive search)
EXHAUSTIVE_OPS = 14
#: on a larger graph, candidate groups of up to this many ops (and the heuristics' kernels)
MAX_SIZE = 5
#: candidates enumerated at most (the enumeration stops there and says so)
MAX_CANDIDATES = 40000
TIME_LIMIT = 60.0


@dataclass(frozen=True)
class Solution:
    """What the integer program found: the ``groups`` of its plan and their predicted ``seconds``,
    the proven lower ``bound`` over the candidates, whether the plan is ``proven`` optimal over
    them, how many ``candidates`` there were and whether they were ``complete`` (every connected
    group of ops), the largest group size allowed, the cycle cuts added and the solver's time."""

    groups: tuple[frozenset[str], ...]
    seconds: float
    bound: float
    proven: bool
    candidates: int
    complete: bool
    largest: int
    cuts: int
    solve_seconds: float

    @property
    def gap(self) -> float:
        """How far the plan may be from the optimum over the candidates (0 when proven)."""
        return 0.0 if self.proven or self.seconds <= 0 else max(0.0, 1 - self.bound / self.seconds)


def _neighbours(graph: Graph) -> dict[str, set[str]]:
    """Ops that may share a kernel with profit: a producer and its reader, two readers of one tensor."""
    names = {op.name for op in graph.ops}
    near: dict[str, set[str]] = {op.name: set() for op in graph.ops}
    readers: dict[str, list[str]] = {}
    for op in graph.ops:
        for tensor in op.input_names:
            if tensor in names:
                near[op.name].add(tensor)
                near[tensor].add(op.name)
                readers.setdefault(tensor, []).append(op.name)
    for group in readers.values():
        for a in group:
            near[a].update(b for b in group if b != a)
    return near


def connected_groups(graph: Graph, max_size: int, limit: int = MAX_CANDIDATES) -> tuple[list[frozenset[str]], bool]:
    """Every connected group of at most ``max_size`` ops (``_neighbours``' edges), each once
    (the ESU enumeration: a group is grown from its first op by ops after it), at most ``limit``
    of them; and whether that was all of them."""
    order = [op.name for op in graph.ops]
    index = {name: k for k, name in enumerate(order)}
    near = _neighbours(graph)
    found: list[frozenset[str]] = []

    def grow(members: frozenset[str], frontier: set[str], root: int, reach: set[str]) -> bool:
        found.append(members)
        if len(found) >= limit:
            return False
        if len(members) == max_size:
            return True
        frontier = set(frontier)
        while frontier:
            new = max(frontier, key=index.__getitem__)
            frontier.discard(new)
            exclusive = {n for n in near[new] if index[n] > root and n not in members and n not in reach}
            if not grow(members | {new}, frontier | exclusive, root, reach | near[new]):
                return False
        return True

    for name in order:
        root = index[name]
        start = {n for n in near[name] if index[n] > root}
        if not grow(frozenset([name]), start, root, near[name] | {name}):
            return found, False
    return found, True


class _Reach:
    """Which ops each op reaches through its readers (bit masks), to tell convex groups."""

    def __init__(self, graph: Graph) -> None:
        self.bit = {op.name: 1 << k for k, op in enumerate(graph.ops)}
        self.below = {op.name: 0 for op in graph.ops}  # descendants
        self.above = {op.name: 0 for op in graph.ops}  # ancestors
        for op in graph.ops:  # topological order
            for tensor in op.input_names:
                if tensor in self.above:
                    self.above[op.name] |= self.above[tensor] | self.bit[tensor]
        for op in reversed(graph.ops):
            for tensor in op.input_names:
                if tensor in self.below:
                    self.below[tensor] |= self.below[op.name] | self.bit[op.name]

    def convex(self, group: Iterable[str]) -> bool:
        """Whether no path leaves ``group`` and comes back into it."""
        mask = below = above = 0
        for name in group:
            mask |= self.bit[name]
            below |= self.below[name]
            above |= self.above[name]
        return not (below & above & ~mask)


def _cycles(groups: Sequence[frozenset[str]], readers: dict[str, list[str]]) -> list[list[int]]:
    """The groups that depend on each other in a cycle: the strongly connected components of more
    than one group of the graph where a group points at the groups that read its ops."""
    home = {name: k for k, group in enumerate(groups) for name in group}
    after: list[set[int]] = [set() for _ in groups]
    for name, k in home.items():
        for reader in readers.get(name, ()):
            if home[reader] != k:
                after[k].add(home[reader])
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    stack: list[int] = []
    on_stack: set[int] = set()
    found: list[list[int]] = []
    for start in range(len(groups)):  # Tarjan's algorithm, without recursion
        if start in index:
            continue
        work = [(start, iter(sorted(after[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(after[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def solve(
    graph: Graph,
    cost_model: CostModel,
    time_limit: float = TIME_LIMIT,
    max_size: int = MAX_SIZE,
    extra: Iterable[frozenset[str]] = (),
    limit: int = MAX_CANDIDATES,
    grouping: Grouping | None = None,
) -> Solution:
    """The cheapest partition of ``graph``'s ops into candidate kernels (module docstring): every
    connected convex group (of at most ``max_size`` ops, all of them on a graph of at most
    ``EXHAUSTIVE_OPS`` ops) and the ``extra`` groups, priced by ``cost_model`` (``grouping``: the
    graph's ``Grouping`` with the cost model's nests, where the caller has one)."""
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array
    except ImportError as err:
        raise CompileError("the optimal fusion policy needs scipy (pip install 'neoflow[research]')") from err
    started = time.perf_counter()
    grouping = grouping or Grouping(graph, nests=cost_model.nests)
    largest = len(graph.ops) if len(graph.ops) <= EXHAUSTIVE_OPS else max_size
    groups, complete = connected_groups(graph, largest, limit)
    reach = _Reach(graph)
    known = set(groups)
    groups += [g for g in dict.fromkeys(extra) if g not in known and len(g) > 0]
    candidates: list[frozenset[str]] = []
    costs: list[float] = []
    for group in groups:
        if not reach.convex(group):
            continue
        kernel = grouping.kernel_alone(group)
        if kernel is None or set(kernel.ops) != group:  # a member nothing in it reads: not this group's kernel
            continue
        candidates.append(group)
        costs.append(cost_model.kernel_cost(graph, kernel).seconds)
    position = {op.name: k for k, op in enumerate(graph.ops)}
    rows = [position[name] for group in candidates for name in group]
    columns = [k for k, group in enumerate(candidates) for _ in group]
    cover = coo_array((np.ones(len(rows)), (rows, columns)), shape=(len(graph.ops), len(candidates)))
    constraints = [LinearConstraint(cover, 1, 1)]
    cuts = 0
    while True:
        remaining = max(1.0, time_limit - (time.perf_counter() - started))
        result = milp(
            np.array(costs),
            integrality=np.ones(len(candidates)),
            bounds=Bounds(0, 1),
            constraints=constraints,
            options={"time_limit": remaining, "mip_rel_gap": 0.0},
        )
        if result.x is None:
            raise CompileError(f"the optimal fusion policy found no plan within {time_limit:g} s ({result.message})")
        chosen = [k for k, value in enumerate(result.x) if value > 0.5]
        picked = [candidates[k] for k in chosen]
        cycles = _cycles(picked, grouping.readers)
        if not cycles:
            break
        for component in cycles:  # not all of these groups together
            row = np.zeros(len(candidates))
            row[[chosen[k] for k in component]] = 1
            constraints.append(LinearConstraint(row, 0, len(component) - 1))
            cuts += 1
        if time.perf_counter() - started > time_limit:
            raise CompileError(f"the optimal fusion policy ran out of time ({time_limit:g} s) cutting cycles")
    seconds = float(sum(costs[k] for k in chosen))
    bound = getattr(result, "mip_dual_bound", None)
    proven = result.status == 0
    return Solution(
        tuple(picked),
        seconds,
        seconds if proven or bound is None else float(bound),
        proven,
        len(candidates),
        complete and largest == len(graph.ops),
        largest,
        cuts,
        time.perf_counter() - started,
    )


class Optimal(FusionPolicy):
    """The cheapest plan under the cost model (module docstring): the partition the integer
    program proves optimal, or a built-in heuristic's plan where that recomputes or slices its way
    below it.  ``time_limit`` seconds for the solver.  The last plan's ``solution``, the predicted
    seconds of the partition it proves optimal (``partition_seconds``) and ``source`` (``partition``,
    ``sliced`` or the heuristic whose plan was kept) are kept for reports."""

    name = "optimal"

    def __init__(self, time_limit: float = TIME_LIMIT, max_size: int = MAX_SIZE) -> None:
        self.time_limit = time_limit
        self.max_size = max_size
        self.solution: Solution | None = None
        self.partition_seconds = float("nan")
        self.source = ""

    def plan(self, graph: Graph, cost_model: CostModel) -> FusionPlan:
        heuristics = {name: policy().plan(graph, cost_model) for name, policy in BUILT_IN.items()}
        extra = [frozenset(kernel.ops) for plan in heuristics.values() for kernel in plan.kernels]
        grouping = Grouping(graph, nests=cost_model.nests)
        solution = self.solution = solve(graph, cost_model, self.time_limit, self.max_size, extra, grouping=grouping)
        partition = plan_from_groups(graph, solution.groups, policy=self.name, nests=cost_model.nests)
        partition_cost = cost_model.plan_cost(graph, partition).seconds
        # the batch-sliced kernel neoflow's search ends with, tried on the optimum as on its plan
        plan = faster_sliced(graph, partition, grouping, cost_model)
        cost = cost_model.plan_cost(graph, plan).seconds
        scope = (
            "every partition into connected kernels"
            if solution.complete
            else f"{solution.candidates} candidate kernels (up to {solution.largest} ops, and the heuristics')"
        )
        proof = "proved optimal" if solution.proven else f"time limit: within {solution.gap:.1%} of the optimum"
        note = (
            f"{proof} over {scope}: {partition_cost * 1e3:.4f} ms predicted "
            f"({solution.cuts} cycle cuts, {solution.solve_seconds:.1f} s)"
        )
        self.partition_seconds, self.source = partition_cost, "partition"
        if plan is not partition:
            note += f"; its ops that slice along the batch in one sliced kernel: {cost * 1e3:.4f} ms"
            self.source = "sliced"
        for name, other in heuristics.items():
            other_cost = cost_model.plan_cost(graph, other).seconds
            if other_cost < cost * (1 - 1e-9):
                note += f"; {name}'s plan (it recomputes or slices) costs {other_cost * 1e3:.4f} ms: kept"
                plan, cost, self.source = replace(other, policy=self.name), other_cost, name
        return replace(plan, notes={**plan.notes, "optimal": note})
