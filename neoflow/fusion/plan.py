"""Fusion plans: a partition of a graph's ops into kernels.

Each kernel lists its ops (in graph order) and which of them are
*materialised* (written to memory: read by another kernel, kept by the caller,
or chosen by the policy) and which are *buffered* (computed once into a tile
buffer of the kernel's own, for its other ops to read: where the target runs
the kernel as one loop nest); the others are *inlined*, recomputed inside the
loops of the kernel ops that read them (``neoflow.fusion.inline``).
``apply_plan`` turns a valid plan into the ops the code generator compiles,
kernel by kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace

from neoflow.errors import CompileError
from neoflow.fusion.inline import InlineMemo, inline_all, recompute_from_reads, why_not_inlined
from neoflow.fusion.slicing import roles_in_kernel
from neoflow.ir.expr import Read, Select
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op


class PlanError(CompileError):
    """A fusion plan the code generator cannot compile, with the reason."""

    kind = "fusion plan error"


@dataclass(frozen=True)
class Kernel:
    """One kernel: ``ops`` in graph order; ``materialized`` are written to
    memory, ``buffered`` are computed once into a tile buffer of the kernel's,
    every other op of the kernel is inlined into its readers.  A kernel with
    ``sliced`` set runs its ops slice by slice along their leading axis,
    ``sliced`` rows a slice (``neoflow.fusion.slicing``); its buffers then hold
    one slice."""

    ops: tuple[str, ...]
    materialized: tuple[str, ...]
    buffered: tuple[str, ...] = ()
    sliced: int = 0

    @property
    def inlined(self) -> tuple[str, ...]:
        """The ops recomputed inside their readers instead of being stored."""
        return tuple(name for name in self.ops if name not in self.materialized and name not in self.buffered)

    @property
    def name(self) -> str:
        """A readable name: the kernel's last materialised op."""
        return self.materialized[-1] if self.materialized else self.ops[-1]


@dataclass(frozen=True)
class FusionPlan:
    """Kernels in execution order; ``policy`` names what made the plan and
    ``notes`` holds a policy's remarks per kernel name (tile sizes chosen, why a
    tensor was recomputed)."""

    kernels: tuple[Kernel, ...]
    policy: str = ""
    notes: Mapping[str, str] = field(default_factory=dict, compare=False)

    def kernel_of(self, op: str) -> Kernel:
        """The kernel holding ``op``."""
        for kernel in self.kernels:
            if op in kernel.ops:
                return kernel
        raise KeyError(op)


def must_store(graph: Graph, keep: Collection[str] = ()) -> set[str]:
    """Tensors every plan materialises: graph outputs, ``keep`` and the next
    values of state the graph updates."""
    return set(graph.outputs) | set(keep) | set(graph.state_updates.values())


def holders(groups: Iterable[Collection[str]]) -> dict[str, list[int]]:
    """For each op name, the positions of the groups holding it (in order)."""
    found: dict[str, list[int]] = {}
    for k, group in enumerate(groups):
        for name in group:
            found.setdefault(name, []).append(k)
    return found


class ShiftedHolders:
    """``holders`` of the groups a move leaves, from the holders of the groups before it, name by
    name as asked: the groups at positions ``removed`` taken out (those after them move up), the
    ``added`` ones appended.  A search scores many moves on one grouping: each asks about a few
    names, where recounting every group's every op was a fifth of a ResNet-18 step's planning."""

    def __init__(
        self, before: dict[str, list[int]], removed: Collection[int], count: int, added: Iterable[Collection[str]]
    ) -> None:
        self.before = before
        self.removed = sorted(removed)
        self.base = count - len(self.removed)
        self.added = list(added)
        self._found: dict[str, list[int]] = {}

    def get(self, name: str, default: list[int] | tuple = ()) -> list[int] | tuple:
        """The positions of the groups holding ``name``, in order (``default`` where none does)."""
        found = self._found.get(name)
        if found is None:
            kept = [k - sum(r < k for r in self.removed) for k in self.before.get(name, ()) if k not in self.removed]
            found = self._found[name] = kept + [self.base + i for i, group in enumerate(self.added) if name in group]
        return found or default

    def __getitem__(self, name: str) -> list[int]:
        found = self.get(name)
        if not found:
            raise KeyError(name)
        return found


#: ``nests(ops, private)``: when the target runs a kernel's fused ``ops`` as one
#: loop nest, which of the ``private`` ones (read by nothing outside) it keeps in
#: tile buffers; None when it does not run them as one loop nest.
Nests = Callable[[list[Op], Collection[str]], Collection[str] | None]


#: nodes an op's expression may reach with the producers its kernel inlines substituted; past it the
#: producer is stored instead (inlining a graph into a tree multiplies a producer by its reads at every
#: level: a BatchNorm adjoint's chain of ops reading the normalised input several times each grows
#: exponentially, and a ResNet-18 training step's planning never finished)
INLINE_NODES = 2000


class Grouping:
    """The rule that turns groups of op names into kernels, with what it needs
    about ``graph`` computed once (policies call it for many candidate groupings).

    An op is materialised, in the first group holding it, when it must be kept
    (``must_store``), when nothing reads it, when some reader cannot inline it
    (a scatter-add, a read inside an index) or when a group holding a reader
    does not hold it and that group's kernel reads it (a reader recomputed
    there may not: ``F = Select(c < 3, A, E)`` recomputed for ``c < 3`` only
    reads ``A``); everywhere else it is inlined.  A group drops the ops it
    holds only for recomputation that nothing left in it reads.  Given the
    target's ``nests``, an op a kernel would inline into two or more of its ops
    is buffered instead where the target's loop nest for the kernel can keep it
    in a tile buffer (computed once, not once per reader).  An op whose expression with its inlined
    producers substituted would exceed ``INLINE_NODES`` nodes is stored where it is computed."""

    def __init__(self, graph: Graph, keep: Collection[str] = (), nests: Nests | None = None) -> None:
        self.graph = graph
        self.nests = nests
        self._buffered: dict[Kernel, Kernel] = {}
        self._reads: dict[Kernel, frozenset[str]] = {}
        self._inlined: InlineMemo = {}
        self.ops = {op.name: op for op in graph.ops}
        self._selecting = {op.name for op in graph.ops if any(isinstance(n, Select) for n in op.body.walk())}
        self.position = {op.name: k for k, op in enumerate(graph.ops)}
        self.readers: dict[str, list[str]] = {}
        for op in graph.ops:
            for name in op.input_names:
                if name in self.ops:
                    self.readers.setdefault(name, []).append(op.name)
        self.always = must_store(graph, keep) | {name for name in self.ops if name not in self.readers}
        self.always |= {
            name
            for name, readers in self.readers.items()
            if any(why_not_inlined(self.ops[r], self.ops[name]) is not None for r in readers)
        }
        # per op: its expression's nodes other than reads of ops, and how often it reads each op
        self._nodes: dict[str, tuple[int, dict[str, int]]] = {}
        for op in graph.ops:
            reads: dict[str, int] = {}
            own = 0
            for node in op.body.walk():
                if isinstance(node, Read) and node.tensor in self.ops:
                    reads[node.tensor] = reads.get(node.tensor, 0) + 1
                else:
                    own += 1
            self._nodes[op.name] = (own, reads)

    def _too_big(self, group: Collection[str], stored: Collection[str], own: Collection[str]) -> set[str]:
        """The ops of ``group`` a kernel storing ``stored`` would inline into expressions of more
        than ``INLINE_NODES`` nodes (taken in graph order, each stored as found), of those it may
        store (``own``: the group is the first holding them; elsewhere they are recomputed)."""
        found: set[str] = set()
        size: dict[str, int] = {}
        for name in sorted(group, key=self.position.__getitem__):
            nodes, reads = self._nodes[name]
            size[name] = nodes + sum(
                count * (size[r] if r in size and r not in stored and r not in found else 1)
                for r, count in reads.items()
            )
            if size[name] > INLINE_NODES and name not in stored and name in own:
                found.add(name)
        return found

    def kernels(self, groups: list[frozenset[str]], which: Iterable[int] | None = None, where=None) -> list[Kernel]:
        """The kernels of ``groups`` (of those at positions ``which``), each
        listing its ops in graph order; empty groups give no kernel (``where``:
        ``holders(groups)`` where the caller has it)."""
        where = holders(groups) if where is None else where
        result = []
        for k in range(len(groups)) if which is None else which:
            materialized = {
                name
                for name in groups[k]
                if where[name][0] == k
                and (
                    name in self.always
                    or any(
                        self._group_reads(groups, where, j, name) for j in self._outside_readers(groups, where, name)
                    )
                )
            }
            materialized |= self._too_big(groups[k], materialized, [n for n in groups[k] if where[n][0] == k])
            kernel = self._kernel(groups[k], materialized)
            if kernel is not None:
                result.append(self._with_buffers(kernel))
        return result

    def kernel_alone(self, group: frozenset[str]) -> Kernel | None:
        """The kernel ``group`` makes in a partition of the ops (each op in one group): an op is
        materialised where it must be kept, a reader cannot inline it or a reader lies outside
        the group (that reader's kernel reads it from memory); the same rules as ``kernels``, with
        no other group to look at (what an exact search prices each candidate group by)."""
        materialized = {
            name for name in group if name in self.always or any(r not in group for r in self.readers.get(name, ()))
        }
        materialized |= self._too_big(group, materialized, group)
        kernel = self._kernel(group, materialized)
        return None if kernel is None else self._with_buffers(kernel)

    def _kernel(self, group: frozenset[str], materialized: Collection[str]) -> Kernel | None:
        """The kernel of ``group`` materialising ``materialized``, less the
        recomputed ops nothing left in it reads; None where nothing is left."""
        members = set(group)
        while True:
            used = {t for name in members for t in self.ops[name].input_names}
            kept = {n for n in members if n in materialized or n in used}
            if kept == members:
                break
            members = kept
        if not members:
            return None
        order = tuple(sorted(members, key=self.position.__getitem__))
        return Kernel(order, tuple(n for n in order if n in materialized))

    def _outside_readers(self, groups: list[frozenset[str]], where: dict[str, list[int]], name: str) -> set[int]:
        """The groups that hold a reader of ``name`` but not ``name``."""
        return {j for r in self.readers.get(name, ()) for j in where[r] if name not in groups[j]}

    def _group_reads(self, groups: list[frozenset[str]], where: dict[str, list[int]], j: int, name: str) -> bool:
        """Whether group ``j``, which holds a reader of ``name`` but not ``name``,
        reads it: always where it stores a reader; where it only recomputes them,
        when its kernel's ops, inlined and simplified, still read it.  (The
        group's stored ops are taken as any outside reader would make them: a
        superset of what it stores, so what it reads is never missed.)"""
        group = groups[j]
        stored = {
            n for n in group if where[n][0] == j and (n in self.always or self._outside_readers(groups, where, n))
        }
        stored |= self._too_big(group, stored, [n for n in group if where[n][0] == j])
        kernel = self._kernel(group, stored)  # less the recomputed ops nothing in it uses
        members = set(kernel.ops) if kernel is not None else set()
        if any(r in stored for r in self.readers.get(name, ()) if r in members):
            return True
        downstream, frontier = set(), [name]  # the kernel's ops that read name, directly or through others
        while frontier:
            found = {r for n in frontier for r in self.readers.get(n, ()) if r in members} - downstream
            downstream |= found
            frontier = list(found)
        if not downstream or downstream.isdisjoint(self._selecting):
            return bool(downstream)  # only a select the inlining folds can take a read away
        reads = self._reads.get(kernel)
        if reads is None:
            reads = self._reads[kernel] = frozenset(
                t.name for op in kernel_ops(self.graph, kernel, self._inlined) for t in op.inputs
            )
        return name in reads

    def _with_buffers(self, kernel: Kernel) -> Kernel:
        """``kernel`` with the inlined ops that two or more of its ops read
        buffered, as many of them as the target's loop nest keeps in tile buffers."""
        if self.nests is None or len(kernel.ops) < 2:
            return kernel
        found = self._buffered.get(kernel)
        if found is None:
            members = set(kernel.ops)
            candidates = tuple(
                name for name in kernel.inlined if sum(r in members for r in self.readers.get(name, ())) >= 2
            )
            chosen: tuple[str, ...] = ()
            while candidates:
                trial = replace(kernel, buffered=candidates)
                kept = self.nests(kernel_ops(self.graph, trial, self._inlined), candidates)
                if kept is None:
                    break
                kept_in_order = tuple(name for name in candidates if name in kept)
                if kept_in_order == candidates:
                    chosen = candidates
                    break
                candidates = kept_in_order  # try again with only those the nest keeps
            found = self._buffered[kernel] = replace(kernel, buffered=chosen)
        return found


def plan_from_groups(
    graph: Graph,
    groups: Iterable[Collection[str]],
    keep: Collection[str] = (),
    policy: str = "",
    notes: Mapping[str, str] | None = None,
    nests: Nests | None = None,
) -> FusionPlan:
    """A plan with one kernel per group of op names (an op may sit in several
    groups: it is then recomputed in each), stored, buffered (given the
    target's ``nests``, a cost model's) and inlined ops decided by
    ``Grouping``.  Kernels are ordered so that each runs after the kernels it
    reads from; the plan is checked with ``validate``."""
    groups = [frozenset(g) for g in groups]
    names = {op.name for op in graph.ops}
    for group in groups:
        for name in sorted(group - names):
            raise PlanError(f"the plan names '{name}', which is not an op of the graph")
    kernels = Grouping(graph, keep, nests).kernels(groups)
    plan = FusionPlan(tuple(_kernel_order(graph, kernels)), policy, dict(notes or {}))
    validate(plan, graph, keep)
    return plan


def plan_from_kernels(
    graph: Graph, kernels: Iterable[Kernel], policy: str = "", notes: Mapping[str, str] | None = None
) -> FusionPlan:
    """A plan of ``kernels`` as they are, ordered so that each runs after the
    kernels it reads from, checked with ``validate``."""
    plan = FusionPlan(tuple(_kernel_order(graph, list(kernels))), policy, dict(notes or {}))
    validate(plan, graph)
    return plan


def unfused(graph: Graph, keep: Collection[str] = (), policy: str = "none") -> FusionPlan:
    """One kernel per op, every op materialised."""
    return plan_from_groups(graph, [[op.name] for op in graph.ops], keep, policy)


def _sources(graph: Graph, kernels: list[Kernel], memo: InlineMemo | None = None) -> list[set[int]]:
    """For each kernel, the kernels whose materialised tensors it reads (``memo``: ``kernel_ops``')."""
    home = {name: k for k, kernel in enumerate(kernels) for name in kernel.materialized}
    ops = {op.name: op for op in graph.ops}
    needs: list[set[int]] = [set() for _ in kernels]
    for k, kernel in enumerate(kernels):
        members = set(kernel.ops)
        for op in kernel_ops(graph, kernel, memo):  # what it reads once its recomputed ops are inlined
            for tensor in op.input_names:
                if tensor in ops and tensor not in members and tensor in home:
                    needs[k].add(home[tensor])
    return needs


def _kernel_order(graph: Graph, kernels: list[Kernel], needs: list[set[int]] | None = None) -> list[Kernel]:
    """``kernels`` in an order where each follows the kernels whose
    materialised tensors it reads (``needs``: their ``_sources`` where known),
    otherwise in the graph's order of each one's first op that no other kernel
    computes too (whatever order a policy listed them in: the backward pass's
    input gradients before its weight gradients, as autodiff wrote them); a
    cycle is a ``PlanError``."""
    needs = _sources(graph, kernels) if needs is None else needs
    position = {op.name: k for k, op in enumerate(graph.ops)}
    where = holders(kernel.ops for kernel in kernels)
    first_own = [
        min((position[name] for name in kernel.ops if len(where[name]) == 1), default=position[kernel.ops[0]])
        for kernel in kernels
    ]
    done: list[int] = []
    state = [0] * len(kernels)

    def visit(k: int, path: list[int]) -> None:
        if state[k] == 2:
            return
        if state[k] == 1:
            cycle = [kernels[j].name for j in path[path.index(k) :]] + [kernels[k].name]
            raise PlanError(f"kernels depend on each other: {' -> '.join(cycle)}")
        state[k] = 1
        for j in sorted(needs[k], key=first_own.__getitem__):
            visit(j, [*path, k])
        state[k] = 2
        done.append(k)

    for k in sorted(range(len(kernels)), key=first_own.__getitem__):
        visit(k, [])
    return [kernels[k] for k in done]


def validate(plan: FusionPlan, graph: Graph, keep: Collection[str] = ()) -> None:
    """Raise ``PlanError`` with the reason unless: every op is in a kernel and
    materialised in at most one; every kept tensor is materialised; an op a
    kernel inlines is not a scatter-add and is read inside that kernel, and so
    is an op it buffers (which it does not also materialise); every
    tensor a kernel reads from outside is materialised by a kernel that runs
    before it (so there is no cycle)."""
    ops = {op.name: op for op in graph.ops}
    memo: InlineMemo = {}  # each kernel's ops inlined once for every check
    home: dict[str, int] = {}
    for k, kernel in enumerate(plan.kernels):
        for name in kernel.ops:
            if name not in ops:
                raise PlanError(f"kernel '{kernel.name}' names '{name}', which is not an op of the graph")
        if len(set(kernel.ops)) != len(kernel.ops):
            raise PlanError(f"kernel '{kernel.name}' lists an op twice")
        extra = set(kernel.materialized) - set(kernel.ops)
        if extra:
            raise PlanError(f"kernel '{kernel.name}' materialises ops it does not hold: {', '.join(sorted(extra))}")
        extra = set(kernel.buffered) - set(kernel.ops)
        if extra:
            raise PlanError(f"kernel '{kernel.name}' buffers ops it does not hold: {', '.join(sorted(extra))}")
        both = set(kernel.buffered) & set(kernel.materialized)
        if both:
            raise PlanError(f"kernel '{kernel.name}' both materialises and buffers {', '.join(sorted(both))}")
        for name in kernel.materialized:
            if name in home:
                raise PlanError(f"'{name}' is materialised by two kernels")
            home[name] = k
    placed = {name for kernel in plan.kernels for name in kernel.ops}
    missing = [name for name in ops if name not in placed]
    if missing:
        raise PlanError(f"ops in no kernel: {', '.join(missing)}")
    for name in must_store(graph, keep):
        if name in ops and name not in home:
            raise PlanError(f"'{name}' must be kept but no kernel materialises it")
    for kernel in plan.kernels:
        members = set(kernel.ops)
        for name in kernel.inlined:
            readers = [ops[r] for r in kernel.ops if name in ops[r].input_names]
            if not readers:
                raise PlanError(f"kernel '{kernel.name}' inlines '{name}' but nothing in it reads '{name}'")
            for reader in readers:
                reason = why_not_inlined(reader, ops[name])
                if reason is not None:
                    raise PlanError(reason)
        for name in kernel.buffered:
            if not any(name in ops[r].input_names for r in kernel.ops):
                raise PlanError(f"kernel '{kernel.name}' buffers '{name}' but nothing in it reads '{name}'")
        for op in kernel_ops(graph, kernel, memo):  # what it reads once its recomputed ops are inlined
            for tensor in op.input_names:
                if tensor in ops and tensor not in members and tensor not in home:
                    raise PlanError(f"kernel '{kernel.name}' reads '{tensor}', which no kernel materialises")
        if kernel.sliced:
            _check_sliced(kernel, kernel_ops(graph, kernel, memo))
    sources = _sources(graph, list(plan.kernels), memo)
    _kernel_order(graph, list(plan.kernels), sources)  # a cycle is an error of its own
    for k, needs in enumerate(sources):
        for j in needs:
            if j > k:
                raise PlanError(
                    f"kernel '{plan.kernels[k].name}' runs before kernel '{plan.kernels[j].name}', which it reads"
                )


def _check_sliced(kernel: Kernel, ops: list[Op]) -> None:
    """Raise ``PlanError`` unless ``ops``, ``kernel``'s fused ops, run slice by
    slice in slices of ``kernel.sliced`` rows."""
    roles = roles_in_kernel(ops, kernel.buffered)
    if isinstance(roles, str):
        raise PlanError(f"kernel '{kernel.name}' cannot run slice by slice: {roles}")
    batch = next(iter(roles.values())).batch
    if kernel.sliced < 1 or batch % kernel.sliced:
        raise PlanError(f"kernel '{kernel.name}': slices of {kernel.sliced} rows do not split its {batch} rows")


def kernel_ops(graph: Graph, kernel: Kernel, memo: InlineMemo | None = None) -> list[Op]:
    """The ops kernel ``kernel`` computes: its materialised and buffered ops,
    in order, with every inlined op substituted into its readers (``memo``:
    ``inline_all``'s, for many kernels of ``graph``)."""
    ops, position = graph.ops_by_name, graph.positions
    return inline_all([ops[name] for name in sorted(kernel.ops, key=position.__getitem__)], kernel.inlined, memo)


def apply_plan(graph: Graph, plan: FusionPlan) -> tuple[Graph, tuple[tuple[str, ...], ...]]:
    """The graph of fused ops for ``plan`` (kernels in plan order, each one's
    materialised ops with inlined producers substituted, and, in every plan but
    the ``none`` policy's (each op alone), cheap pointwise tensors recomputed from
    what a kernel reads anyway: ``recompute_from_reads``) and, per kernel, the
    names of the ops it runs."""
    fused: list[Op] = []
    groups = []
    producers = {op.name: op for op in graph.ops}
    for kernel in plan.kernels:
        roots = kernel_ops(graph, kernel)
        if plan.policy != "none":
            roots = [recompute_from_reads(op, producers) for op in roots]
        fused.extend(roots)
        groups.append(tuple(op.name for op in roots))
    result = Graph(
        tuple(fused),
        graph.inputs,
        graph.outputs,
        graph.parameters,
        graph.source_names,
        graph.state_updates,
        graph.noise_inputs,
    )
    return result, tuple(groups)
