"""Batch slicing: a kernel of many ops run slice by slice along their leading axis.

A training step's ops mostly carry the batch as their leading axis and read
each other only at their own batch index: the capsule network's ``c1 → a1 →
c2 → logits → loss → grad_logits → ... → grad_c1`` all compute row ``b`` from
rows ``b`` of what they read.  Such ops fuse whatever their kind (heavy→heavy,
forward with backward) by running the whole group one slice of rows at a time,
each thread its own slices: an intermediate lives in a buffer one slice long
(it never reaches memory), and the group is one call instead of one per op.
An op summing over the batch (a weight's gradient, the loss) joins as a
partial sum per thread, added up once every slice is done.

An op's *role* (``slice_role``) says how it slices: ``rows`` (its output's
leading axis is the sliced one) or ``sum`` (it sums its sliced axis away); the
tensors it reads at the sliced index, at axis 0, are read slice by slice and
every other tensor whole.  ``sliced_ops`` picks the ops a kernel can slice
together.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from neoflow.ir import index
from neoflow.ir.expr import Binary, Expr, Index, Read, Reduce, bound_variables
from neoflow.ir.op import Op, Tensor

ROWS, SUM = "rows", "sum"


@dataclass(frozen=True)
class SliceRun:
    """A fusion plan's sliced kernel as the executor runs it: its fused ``ops`` (in
    order), ``length`` rows a slice, and the ops kept in slice buffers (``private``)."""

    ops: tuple[str, ...]
    length: int
    private: tuple[str, ...] = ()


@dataclass(frozen=True)
class Role:
    """How an op runs in a sliced kernel: ``kind`` is ``rows`` or ``sum``;
    ``variable`` its index variable over the ``batch`` rows; ``sliced`` the
    tensors it reads at that variable (axis 0), slice by slice."""

    kind: str
    variable: str
    batch: int
    sliced: frozenset[str]


def _top_sum(body: Expr) -> Reduce | None:
    """The sum ``body`` is, up to a factor free of reductions (``ReduceAdd(...) / 32``)."""
    if isinstance(body, Reduce):
        return body if body.kind == "ReduceAdd" else None
    if isinstance(body, Binary) and body.op in ("*", "/"):
        if isinstance(body.a, Reduce) and not bound_variables(body.b):
            return _top_sum(body.a)
        if body.op == "*" and isinstance(body.b, Reduce) and not bound_variables(body.a):
            return _top_sum(body.b)
    return None


def _sliced_reads(op: Op, variable: str) -> frozenset[str] | None:
    """The tensors ``op`` reads with ``variable`` as their leading index, when
    every use of ``variable`` is such a read (and the tensor has exactly the
    variable's extent of rows, read nowhere else in ``op`` otherwise); None when
    ``variable`` is used any other way."""
    symbol = index.var(variable)
    extent = op.extent[variable]
    shapes = {t.name: t.shape for t in op.inputs}
    sliced, whole = set(), set()
    for node in op.body.walk():
        if isinstance(node, Index) and symbol in node.expr.free_symbols:
            return None
        if not isinstance(node, Read):
            continue
        uses = [symbol in i.free_symbols for i in node.indices]
        if not any(uses):
            whole.add(node.tensor)
            continue
        if node.indices[0] != symbol or any(uses[1:]) or shapes[node.tensor][0] != extent:
            return None
        sliced.add(node.tensor)
    return None if sliced & whole else frozenset(sliced)


def slice_role(op: Op) -> Role | None:
    """How ``op`` runs slice by slice along its leading axis (``rows``), or along
    the batch it sums away (``sum``), or None when it cannot: a scatter op, a
    leading axis of one, or the sliced variable used other than as the leading
    index of a read."""
    if op.scatter is not None:
        return None
    if op.indices and op.shape[0] > 1:
        variable = op.indices[0]
        if variable not in bound_variables(op.body):
            sliced = _sliced_reads(op, variable)
            if sliced is not None:
                return Role(ROWS, variable, op.shape[0], sliced)
    total = _top_sum(op.body)
    if total is None:
        return None
    nested = [r for r in op.reductions if r is not total]
    for variable in total.axes:
        if op.extent[variable] < 2 or any(variable in r.axes for r in nested):
            continue
        sliced = _sliced_reads(op, variable)
        if sliced:
            return Role(SUM, variable, op.extent[variable], sliced)
    return None


def slice_length(batch: int, threads: int) -> int:
    """Rows a slice: the fewest that split ``batch`` into at most ``threads``
    equal slices (every thread one slice where ``threads`` divides it)."""
    return next(length for length in range(1, batch + 1) if batch % length == 0 and batch // length <= threads)


def roles_in_kernel(ops: Sequence[Op], private: Collection[str] = ()) -> dict[str, Role] | str:
    """Each of ``ops``' role when they run as one sliced kernel (in order), or
    the reason they cannot: every op needs a role over the same batch; an op
    the kernel computes is read only row by row by the later ones, never when it
    is a sum (complete only after the last slice); ``private`` ones (kept in a
    slice buffer) are rows."""
    roles: dict[str, Role] = {}
    for op in ops:
        role = slice_role(op)
        if role is None:
            return f"'{op.name}' does not run slice by slice along a leading axis"
        if roles and role.batch != next(iter(roles.values())).batch:
            return f"'{op.name}' runs over {role.batch} rows, not {next(iter(roles.values())).batch}"
        for name in op.input_names:
            if name not in roles:
                continue
            if roles[name].kind == SUM:
                return f"'{op.name}' reads the sum '{name}' before its last slice"
            if name not in role.sliced:
                return f"'{op.name}' reads '{name}' other than row by row"
        if op.name in private and role.kind != ROWS:
            return f"'{op.name}' is a sum, which no slice buffer can hold"
        roles[op.name] = role
    return roles


def sliced_ops(ops: Sequence[Op], candidates: Collection[str]) -> tuple[str, ...]:
    """Of ``candidates`` (names of ``ops``, which are in graph order), the ones
    one sliced kernel can run: those with a role over the batch most of them
    share, less every one that would read a sum of the kernel, read one of its
    rows other than row by row, or depend on an op outside the kernel that
    depends on it (the kernel could not run before nor after that op)."""
    roles = {op.name: slice_role(op) for op in ops if op.name in candidates}
    batches: dict[int, int] = {}
    for role in roles.values():
        if role is not None:
            batches[role.batch] = batches.get(role.batch, 0) + 1
    if not batches:
        return ()
    batch = max(batches, key=lambda b: (batches[b], b))
    chosen: dict[str, Role] = {}
    after: set[str] = set()  # ops outside the kernel that depend on it
    for op in ops:
        inside = set(op.input_names) & chosen.keys()
        waits = not after.isdisjoint(op.input_names)
        role = roles.get(op.name)
        if (
            role is not None
            and role.batch == batch
            and not waits
            and all(chosen[name].kind == ROWS and name in role.sliced for name in inside)
        ):
            chosen[op.name] = role
        elif inside or waits:
            after.add(op.name)
    return tuple(chosen)


def slice_tensor(tensor: Tensor, length: int) -> Tensor:
    """``tensor``'s slice of ``length`` rows: its leading axis cut to ``length``."""
    return Tensor(tensor.name, (length, *tensor.shape[1:]), tensor.dtype)


def slice_shapes(op: Op, role: Role, length: int) -> Op:
    """``op`` over one slice of ``length`` rows: its sliced variable's extent, and
    the leading axis of its output (``rows``) and of the tensors it reads slice
    by slice, cut to ``length``."""
    ranges = tuple((name, length if name == role.variable else extent) for name, extent in op.ranges)
    output = slice_tensor(op.output, length) if role.kind == ROWS else op.output
    inputs = tuple(slice_tensor(t, length) if t.name in role.sliced else t for t in op.inputs)
    return replace(op, output=output, inputs=inputs, ranges=ranges)
