"""Fusion policies: plug-ins that turn (graph, cost model) into a fusion plan.

Built in: ``none`` (one op per kernel), ``elementwise`` (light→light chains
and heavy→light epilogues, what most frameworks do), ``neoflow`` (all four
patterns, recomputation against storing, forward/backward coupling; every
decision by the cost model) and ``chimera`` (compute-intensive heavy→heavy
chains on top of ``elementwise``).  A policy of your own is any class with a
``plan(graph, cost_model)`` method, named as ``module:Class``.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Iterable

from neoflow.errors import CompileError
from neoflow.fusion.cost import CostModel
from neoflow.fusion.inline import inline, why_not_inlined
from neoflow.fusion.patterns import HEAVY, LIGHT, is_epilogue, kind, recomputable
from neoflow.fusion.plan import (
    FusionPlan,
    Grouping,
    Kernel,
    PlanError,
    ShiftedHolders,
    holders,
    must_store,
    plan_from_groups,
    plan_from_kernels,
    unfused,
)
from neoflow.fusion.slicing import slice_length, slice_role, sliced_ops
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op


class FusionPolicy:
    """Base class of fusion policies: ``plan`` returns a ``FusionPlan`` for
    ``graph`` (its outputs are the tensors that must be kept)."""

    name = "policy"

    def plan(self, graph: Graph, cost_model: CostModel) -> FusionPlan:
        raise NotImplementedError(f"{type(self).__name__} must define plan(graph, cost_model)")


class NoFusion(FusionPolicy):
    """Every op its own kernel, every tensor stored."""

    name = "none"

    def plan(self, graph: Graph, cost_model: CostModel) -> FusionPlan:
        return unfused(graph, policy=self.name)


class _Groups:
    """A partition of a graph's ops into groups (union-find), with the group
    order checks a policy needs before merging two groups."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.parent = {op.name: op.name for op in graph.ops}
        grouping = Grouping(graph)
        self.ops, self.readers = grouping.ops, grouping.readers
        self.kept = must_store(graph)

    def find(self, name: str) -> str:
        while self.parent[name] != name:
            self.parent[name] = self.parent[self.parent[name]]
            name = self.parent[name]
        return name

    def members(self) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for op in self.graph.ops:
            groups.setdefault(self.find(op.name), []).append(op.name)
        return groups

    def can_merge(self, a: str, b: str) -> bool:
        """Whether merging the groups of ``a`` and ``b`` keeps the kernels
        acyclic (no path between them through a third group)."""
        ga, gb = self.find(a), self.find(b)
        if ga == gb:
            return False
        groups = self.members()
        merged = [frozenset(g) for root, g in groups.items() if root not in (ga, gb)]
        merged.append(frozenset(groups[ga] + groups[gb]))
        return not _cyclic(merged, self.readers)

    def merge(self, a: str, b: str) -> None:
        self.parent[self.find(a)] = self.find(b)


def _single_reader(groups: _Groups, name: str) -> Op | None:
    """The one op reading ``name`` when it has exactly one and need not be kept."""
    readers = groups.readers.get(name, [])
    return groups.ops[readers[0]] if len(readers) == 1 and name not in groups.kept else None


def _elementwise_groups(graph: Graph) -> _Groups:
    """light→light chains and heavy→light epilogues whose producer has one
    reader and is not kept."""
    groups = _Groups(graph)
    for op in graph.ops:
        reader = _single_reader(groups, op.name)
        if reader is None or kind(reader) != LIGHT:
            continue
        if kind(op) == HEAVY and not is_epilogue(op, reader):
            continue
        if groups.can_merge(op.name, reader.name):
            groups.merge(op.name, reader.name)
    return groups


class Elementwise(FusionPolicy):
    """Fuse element-wise chains and epilogues (a producer with one reader)."""

    name = "elementwise"

    def plan(self, graph: Graph, cost_model: CostModel) -> FusionPlan:
        return plan_from_groups(graph, _elementwise_groups(graph).members().values(), policy=self.name)


class NeoFlow(FusionPolicy):
    """Generalised fusion: all four patterns, recomputation or storage of
    multi-reader producers, forward and backward ops alike, chosen greedily by
    the cost model: of all moves (merge the kernels at the two ends of an
    edge, or two kernels reading the same tensor; recompute a light producer
    inside one reader's kernel or inside all of them), take the one that saves
    the most predicted time, until none saves any."""

    name = "neoflow"

    def plan(self, graph: Graph, cost_model: CostModel) -> FusionPlan:
        search = _Search(graph, cost_model)
        groups: list[frozenset[str]] = [frozenset([op.name]) for op in graph.ops]
        while True:
            moves = list(_moves(graph, groups, search.ops, cost_model.machine.recomputed_terms))
            where = holders(groups)
            scored = sorted((search.delta(groups, m, where), k) for k, m in enumerate(moves))
            # take the best move, then every other saving move on groups no taken move touched
            taken: list[_Move] = []
            used: set[int] = set()
            for delta, k in scored:
                if delta >= -1e-9:
                    break
                removed, _ = moves[k]
                if removed & used or _cyclic(_apply(groups, [*taken, moves[k]]), search.readers):
                    continue
                taken.append(moves[k])
                used |= removed
            if not taken:
                break
            # each group as the kernel it makes: an op recomputed where nothing reads it any more
            # leaves the group, so later merges see the kernels the plan really has
            groups = [frozenset(kernel.ops) for kernel in search.grouping.kernels(_apply(groups, taken))]
        plan = plan_from_groups(graph, groups, policy=self.name, nests=cost_model.nests)
        return faster_sliced(graph, plan, search.grouping, cost_model)


def faster_sliced(graph: Graph, plan: FusionPlan, grouping: Grouping, cost_model: CostModel) -> FusionPlan:
    """``plan``, or its ``sliced`` variant where the cost model predicts that faster."""
    sliced = _sliced(graph, plan, grouping, cost_model)
    if sliced is None:
        return plan
    faster = cost_model.plan_cost(graph, sliced).seconds < cost_model.plan_cost(graph, plan).seconds
    return sliced if faster else plan


def _sliced(graph: Graph, plan: FusionPlan, grouping: Grouping, cost_model: CostModel) -> FusionPlan | None:
    """``plan`` with the ops that can run slice by slice along their batch
    (``fusion.slicing``) taken out of its kernels into one sliced kernel: what
    another kernel reads from it is stored; what ``plan`` stored, and every heavy
    op, stays in a slice buffer where nothing outside reads it; the light ops
    ``plan`` recomputed are recomputed there too.  None where fewer than two ops
    slice, the kernel would not run or the target runs no sliced kernels."""
    if not cost_model.machine.sliced_kernels:
        return None
    names = sliced_ops(graph.ops, [op.name for op in graph.ops])
    if len(names) < 2:
        return None
    inside = frozenset(names)
    groups = [group for group in (frozenset(kernel.ops) - inside for kernel in plan.kernels) if group]
    groups.append(inside)
    kernels = grouping.kernels(groups, range(len(groups) - 1))
    whole = grouping.kernels(groups, [len(groups) - 1])[0]
    # computed once a slice: what plan stored, and every heavy op (its output never reaches memory, so an
    # epilogue reads it from the slice buffer in cache: recomputing it inside the epilogue's loops is slower)
    stored = {name for kernel in plan.kernels for name in (*kernel.materialized, *kernel.buffered)}
    buffered = tuple(
        name
        for name in whole.ops
        if (name in stored or kind(grouping.ops[name]) == HEAVY) and name not in whole.materialized
    )
    batch = slice_role(grouping.ops[names[0]]).batch
    length = slice_length(batch, cost_model.machine.threads)
    sliced = Kernel(whole.ops, whole.materialized, buffered, length)
    note = (
        f"{len(whole.ops)} ops run in {batch // length} slice(s) of {length} rows along their batch, "
        f"{len(buffered)} intermediates in slice buffers"
    )
    try:
        return plan_from_kernels(graph, [*kernels, sliced], plan.policy, {**plan.notes, sliced.name: note})
    except PlanError:
        return None


class _Search:
    """Predicted time of the kernels a move changes, without building whole plans."""

    def __init__(self, graph: Graph, cost_model: CostModel) -> None:
        self.graph = graph
        self.cost_model = cost_model
        self.grouping = Grouping(graph, nests=cost_model.nests)
        self.ops = self.grouping.ops
        self.readers = self.grouping.readers
        # the kernels of the current groups by position: every move of a round starts from them
        self._current: tuple[list[frozenset[str]] | None, dict[int, list[Kernel]]] = (None, {})

    def _kernels_of(self, groups: list[frozenset[str]], positions: list[int], where) -> list[Kernel]:
        """The kernels of ``groups`` at ``positions`` (``grouping.kernels``), each worked out once a round."""
        if self._current[0] is not groups:
            self._current = (groups, {})
        known = self._current[1]
        found = []
        for k in positions:
            if k not in known:
                known[k] = self.grouping.kernels(groups, [k], where)
            found += known[k]
        return found

    def delta(self, old: list[frozenset[str]], move: _Move, where: dict[str, list[int]]) -> float:
        """Predicted seconds of the plan ``move`` makes of ``old`` (whose ``holders`` are ``where``)
        minus those of ``old``.  Only kernels that differ are costed: the kernels of the two that
        hold exactly the same ops and materialise the same tensors cancel."""
        new = _apply(old, [move])
        new_where = ShiftedHolders(where, move[0], len(old), [g for g in move[1] if g])
        # groups whose ops, or whose ops' readers, moved: their kernels may differ
        moved = set().union(*(g for g in set(old) ^ set(new)))
        touched = moved | {t for name in moved for t in self.ops[name].input_names}
        before = set(self._kernels_of(old, _holding(where, touched), where))
        after = set(self.grouping.kernels(new, _holding(new_where, touched), new_where))
        # summed in a fixed order: in a set's (hash-seeded) order, the float sums of equal moves came out
        # a rounding apart from run to run, and which one the search took with them
        seconds = 0.0
        for kernel in sorted(after - before, key=_kernel_key):
            seconds += self.cost_model.kernel_cost(self.graph, kernel).seconds
        for kernel in sorted(before - after, key=_kernel_key):
            seconds -= self.cost_model.kernel_cost(self.graph, kernel).seconds
        return seconds


def _kernel_key(kernel: Kernel) -> tuple:
    return kernel.ops, kernel.materialized, kernel.buffered, kernel.sliced


def _holding(where, names: set[str]) -> list[int]:
    """The positions of the groups holding any of ``names``, in order (``where``: their ``holders``)."""
    return sorted({k for name in names for k in where.get(name, ())})


def _cyclic(groups: list[frozenset[str]], readers: dict[str, list[str]]) -> bool:
    """Whether the groups' read dependencies form a cycle."""
    where = holders(groups)
    successors: list[set[int]] = [set() for _ in groups]
    for name, found in where.items():
        for reader in readers.get(name, ()):
            for k in where[reader]:
                if k not in found:
                    successors[found[0]].add(k)
    state = [0] * len(groups)
    for start in range(len(groups)):
        if state[start]:
            continue
        stack = [(start, iter(successors[start]))]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state[child] == 1:
                return True
            elif state[child] == 0:
                state[child] = 1
                stack.append((child, iter(successors[child])))
    return False


#: A move: the indices of the groups it replaces and the groups it puts in their place.
_Move = tuple[frozenset[int], tuple[frozenset[str], ...]]


def _apply(groups: list[frozenset[str]], moves: list[_Move]) -> list[frozenset[str]]:
    removed = set().union(*(m[0] for m in moves))
    return [g for k, g in enumerate(groups) if k not in removed] + [g for m in moves for g in m[1] if g]


def _moves(graph: Graph, groups: list[frozenset[str]], ops: dict[str, Op], terms: int = 0) -> Iterable[_Move]:
    """Candidate moves: merge the groups at the two ends of an edge, or two
    groups that read the same tensor or recompute the same op (siblings: a
    forward and a backward kernel reading one activation); recompute a light
    producer (or a reduction of at most ``terms`` terms a point) inside one reader's
    group, or inside every reader's group (then it is stored nowhere unless it must be kept)."""
    where = holders(groups)
    seen = set()
    for op in graph.ops:
        for name in op.input_names:
            if name not in ops:
                continue
            for b in where[op.name]:
                if name in groups[b]:
                    continue
                a = where[name][0]
                if (a, b) not in seen:
                    seen.add((a, b))
                    yield frozenset((a, b)), (groups[a] | groups[b],)
                if recomputable(ops[name], terms):
                    yield frozenset((b,)), (groups[b] | {name},)
    # siblings: groups that read the same tensor, or that both recompute one op
    sharing: dict[str, set[int]] = {}
    for k, group in enumerate(groups):
        for name in group:
            sharing.setdefault(name, set()).add(k)
            for tensor in ops[name].input_names:
                if tensor in ops and tensor not in group:
                    sharing.setdefault(tensor, set()).add(k)
    for name in sorted(sharing):
        for a, b in itertools.combinations(sorted(sharing[name]), 2):
            if (a, b) not in seen and (b, a) not in seen:
                seen.add((a, b))
                yield frozenset((a, b)), (groups[a] | groups[b],)
    stored = must_store(graph)
    for op in graph.ops:
        if not recomputable(op, terms) or op.name in stored:
            continue
        readers = {k for k, g in enumerate(groups) if any(op.name in ops[r].input_names for r in g)}
        home = set(where[op.name])
        if not readers or readers <= home:
            continue
        changed = sorted(readers | home)
        yield (
            frozenset(changed),
            tuple(groups[k] | {op.name} if k in readers else groups[k] - {op.name} for k in changed),
        )


class Chimera(FusionPolicy):
    """``elementwise``, plus compute-intensive chains: a heavy op whose only
    reader is heavy joins that reader's kernel when the cost model predicts the
    pair together to be faster than apart.  On the cpu target a GEMM chain so
    fused runs as one kernel holding the intermediate in a tile buffer
    (``targets.cpu.chain``, tiles by Chimera's data-movement analysis); where the
    target has no such kernel the pair costs a recomputation per read, which
    the cost model refuses."""

    name = "chimera"

    def plan(self, graph: Graph, cost_model: CostModel) -> FusionPlan:
        groups = _elementwise_groups(graph)
        notes = {}
        for op in graph.ops:
            reader = _single_reader(groups, op.name)
            chain = reader is not None and kind(op) == HEAVY and kind(reader) == HEAVY
            if not chain or why_not_inlined(reader, op) is not None or not groups.can_merge(op.name, reader.name):
                continue
            together = cost_model.op_cost(inline(reader, op))
            apart = cost_model.op_cost(op) + cost_model.op_cost(reader)
            if together.seconds < apart.seconds:
                groups.merge(op.name, reader.name)
                notes[reader.name] = (
                    f"'{op.name}' -> '{reader.name}' tiled together: predicted {together.seconds * 1e3:.3f} ms "
                    f"against {apart.seconds * 1e3:.3f} ms apart"
                )
        return plan_from_groups(graph, groups.members().values(), policy=self.name, notes=notes)


BUILT_IN: dict[str, type[FusionPolicy]] = {policy.name: policy for policy in (NoFusion, Elementwise, NeoFlow, Chimera)}


def load_policy(spec: str | FusionPolicy) -> FusionPolicy:
    """A policy by built-in name (``none``, ``elementwise``, ``neoflow``,
    ``chimera``, and ``optimal``, the exact baseline) or as ``package.module:Class``; an instance is returned as it
    is.  Raises ``CompileError`` naming what could not be found."""
    if not isinstance(spec, str):
        if not callable(getattr(spec, "plan", None)):
            raise CompileError(f"{spec!r} is not a fusion policy (it has no plan method)")
        return spec
    if spec in BUILT_IN:
        return BUILT_IN[spec]()
    if spec == "optimal":  # the exact baseline (``fusion.optimal``, built on these policies)
        from neoflow.fusion.optimal import Optimal

        return Optimal()
    if ":" not in spec:
        raise CompileError(
            f"unknown fusion policy '{spec}' (built in: {', '.join(BUILT_IN)}, optimal; or give module:Class)"
        )
    module_name, _, class_name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise CompileError(f"fusion policy '{spec}': cannot import '{module_name}' ({err})") from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise CompileError(f"fusion policy '{spec}': module '{module_name}' has no '{class_name}'")
    policy = cls() if isinstance(cls, type) else cls
    if not callable(getattr(policy, "plan", None)):
        raise CompileError(f"fusion policy '{spec}': '{class_name}' has no plan(graph, cost_model) method")
    return policy


__all__ = ["BUILT_IN", "Chimera", "Elementwise", "FusionPolicy", "Kernel", "NeoFlow", "NoFusion", "load_policy"]
