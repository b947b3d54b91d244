"""AMOS-style intrinsic mapping: which op axes can run on which intrinsic axes, and at what cost.

An op that is a contraction, ``Out[x] = ReduceAdd({r}, A[f(x, r)] * B[g(x, r)])``
(reads may sit under a ``Select`` guard, as padding does), is matched against
an intrinsic ``c[..] += a[..] * b[..]`` as AMOS does:

1. the operands are assigned (``a``, ``b``) ← (``A``, ``B``) or (``B``, ``A``); ``c`` ← ``Out``;
2. every op variable has an *access vector*: which of ``Out``, ``A``, ``B`` its
   index expressions mention; every intrinsic axis has one over ``c``, ``a``, ``b``;
3. an op variable may be mapped onto an intrinsic axis only when the two
   vectors agree under the operand assignment (the binary access-matrix check);
   each intrinsic axis takes a non-empty group of op variables (fused into it),
   the remaining variables stay outer loops around the intrinsic.

Candidates are scored by an analytical model: compute cycles of the padded
intrinsic calls, and the bytes each memory level moves for a tiling that fits
its capacity, against its bandwidth; the estimate is the slowest of them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from neoflow.codegen.hardware import Hardware, Intrinsic, hardware
from neoflow.ir import dtypes as dt
from neoflow.ir.expr import Binary, Expr, Read, Reduce, index_variables
from neoflow.ir.op import Op


@dataclass(frozen=True)
class Contraction:
    """An op recognised as a sum of products of two reads."""

    op: Op
    left: Read
    right: Read
    reduce_axes: tuple[str, ...]

    def access(self) -> dict[str, frozenset[str]]:
        """For each op variable, which of ``out``, the left and the right tensor it indexes."""
        table: dict[str, set[str]] = {v: set() for v in (*self.op.indices, *self.reduce_axes)}
        for v in self.op.indices:
            table[v].add("out")
        for role, read in (("left", self.left), ("right", self.right)):
            for expr in read.indices:
                for symbol in expr.free_symbols:
                    if symbol.name in table:
                        table[symbol.name].add(role)
        return {v: frozenset(r) for v, r in table.items()}


def _operand(node: Expr) -> Read | None:
    """The one read an operand is a function of: the read itself, under casts,
    a padding guard (``Select(cond, read, 0)``) or an element-wise prologue a
    fusion plan inlined (``max(h[i, k], 0)``), as long as the expression reads
    one tensor element and uses no variable that element's indices do not."""
    reads = {n for n in node.walk() if isinstance(n, Read)}
    if len(reads) != 1 or any(isinstance(n, Reduce) for n in node.walk()):
        return None
    (read,) = reads
    return read if index_variables(node) <= index_variables(read) else None


def contraction(op: Op) -> Contraction | None:
    """``op`` as a ``Contraction``, or None when it is not a sum of products of two
    different reads over a whole box (a reduction with a domain condition is not)."""
    body = op.body
    if op.scatter is not None or not isinstance(body, Reduce) or body.kind != "ReduceAdd" or body.where is not None:
        return None
    product = body.body
    if not isinstance(product, Binary) or product.op != "*":
        return None
    left, right = _operand(product.a), _operand(product.b)
    if left is None or right is None or left.tensor == right.tensor:
        return None
    return Contraction(op, left, right, tuple(body.axes))


@dataclass(frozen=True)
class Mapping:
    """One way to run a contraction on an intrinsic: operand assignment, op
    variables fused onto each intrinsic axis, outer loops, and the estimate."""

    hardware: str
    intrinsic: str
    operands: tuple[tuple[str, str], ...]  # intrinsic tensor -> op tensor
    axes: tuple[tuple[str, tuple[str, ...]], ...]  # intrinsic axis -> op variables
    outer: tuple[str, ...]
    utilization: float
    cycles: float
    bound: str  # what limits it: compute or a memory level

    def describe(self) -> str:
        """e.g. ``outer_product: i<-(n, p, q) j<-(k) k<-(c, r, s); a=X b=W; outer (); util 100%``."""
        axes = " ".join(f"{axis}<-({', '.join(vs)})" for axis, vs in self.axes)
        operands = " ".join(f"{t}={name}" for t, name in self.operands)
        return (
            f"{self.intrinsic}: {axes}; {operands}; outer ({', '.join(self.outer)}); "
            f"utilization {self.utilization:.0%}; {self.cycles:.3g} cycles ({self.bound}-bound)"
        )


def check_mapping(
    op: Op, intrinsic: Intrinsic, operands: dict[str, str], axes: dict[str, tuple[str, ...]]
) -> str | None:
    """Why mapping ``op`` onto ``intrinsic`` this way is invalid, or None if it is valid.

    ``operands`` maps ``a``, ``b`` (and optionally ``c``) to op tensors; ``axes`` maps
    each intrinsic axis to the op variables fused onto it."""
    form = contraction(op)
    if form is None:
        return f"'{op.name}' is not a sum of products of two tensors"
    names = {form.left.tensor: "left", form.right.tensor: "right", op.name: "out"}
    role_of = {"c": "out"}
    for t in ("a", "b"):
        if operands.get(t) not in names or names[operands[t]] == "out":
            return f"intrinsic operand {t} must be one of {form.left.tensor}, {form.right.tensor}"
        role_of[t] = names[operands[t]]
    if role_of["a"] == role_of["b"]:
        return "a and b must be different operands"
    access = form.access()
    used: set[str] = set()
    for axis in intrinsic.axes:
        group = axes.get(axis, ())
        if not group:
            return f"intrinsic axis {axis} has no op variable"
        want = frozenset(role_of[t] for t in intrinsic.roles[axis])
        for v in group:
            if v not in access:
                return f"'{v}' is not a variable of '{op.name}'"
            if v in used:
                return f"'{v}' is mapped twice"
            used.add(v)
            if access[v] != want:
                have = ", ".join(sorted(access[v]))
                return (
                    f"'{v}' indexes ({have}) but intrinsic axis {axis} indexes "
                    f"({', '.join(sorted(intrinsic.roles[axis]))}) = ({', '.join(sorted(want))})"
                )
    return None


def _subsets(items: list[str]) -> list[tuple[str, ...]]:
    return [c for r in range(1, len(items) + 1) for c in itertools.combinations(items, r)]


def _estimate(
    form: Contraction, target: Hardware, intrinsic: Intrinsic, axes: dict[str, tuple[str, ...]], outer: tuple[str, ...]
) -> tuple[float, float, str]:
    """(utilization, cycles, bound) of a mapping under the analytical model."""
    extent = form.op.extent
    sizes = dict(intrinsic.sizes)
    mapped = {axis: math.prod(extent[v] for v in group) for axis, group in axes.items()}
    calls_per_axis = {axis: -(-mapped[axis] // sizes[axis]) for axis in axes}
    useful = math.prod(mapped.values())
    padded = math.prod(calls_per_axis[a] * sizes[a] for a in axes)
    outer_points = math.prod(extent[v] for v in outer)
    calls = outer_points * math.prod(calls_per_axis.values())
    compute = calls * intrinsic.cycles / max(target.cores, 1)
    elem = dt.numpy_dtype(intrinsic.input_dtype).itemsize
    acc = dt.numpy_dtype(intrinsic.accumulator_dtype).itemsize
    c_total = form.op.output.size * acc
    compulsory = sum(t.size * elem for t in form.op.inputs) + c_total
    worst, bound = compute, "compute"
    # operand loads: each call loads its a and b tiles, a vector at a time (a tile narrower
    # than a vector is broadcast element by element, a matrix tile is one fragment load)
    lanes = max(target.vector_bytes // elem, 1)
    loads = 0
    for operand in ("a", "b"):
        count = math.prod(sizes[x] for x in intrinsic.axes if operand in intrinsic.roles[x])
        matrix = sum(operand in intrinsic.roles[x] for x in intrinsic.axes) == 2 and count >= lanes * lanes
        loads += 1 if matrix else (-(-count // lanes) if count >= lanes else count)
    cycles = calls * loads / target.loads_per_cycle / max(target.cores, 1)
    if cycles > worst:
        worst, bound = cycles, "load"
    # outer scopes: a tiling whose operand panels fit the scope re-reads the operands
    # 2 * MNK / sqrt(capacity / elem) times (the classic bound for matrix products), at least once
    macs = math.prod(extent[v] for v in extent)
    for scope in target.scopes[1:] if target.scopes[0].name in ("registers", "fragment") else target.scopes:
        moved = max(compulsory, 2 * macs * elem / math.sqrt(max(scope.capacity / elem, 1.0)))
        cycles = moved / scope.bandwidth / max(target.cores, 1)
        if cycles > worst:
            worst, bound = cycles, scope.name
    return useful / padded, worst, bound


def mappings(op: Op, target: str | Hardware = "cpu", intrinsic: str | None = None) -> list[Mapping]:
    """Every valid mapping of ``op`` onto the intrinsics of ``target`` (or only
    ``intrinsic``), best (fewest estimated cycles) first.  An op that is not a
    contraction has none."""
    form = contraction(op)
    if form is None:
        return []
    target = hardware(target)
    access = form.access()
    variables = list(access)
    found: list[Mapping] = []
    for item in target.intrinsics:
        if intrinsic is not None and item.name != intrinsic:
            continue
        if "a" not in item.roles.get(item.axes[0], set()) and not any("b" in r for r in item.roles.values()):
            continue
        for a_role, b_role in (("left", "right"), ("right", "left")):
            role_of = {"c": "out", "a": a_role, "b": b_role}
            tensor_of = {"out": op.name, "left": form.left.tensor, "right": form.right.tensor}
            candidates = {}
            for axis in item.axes:
                want = frozenset(role_of[t] for t in item.roles[axis])
                candidates[axis] = [v for v in variables if access[v] == want]
            if any(not c for c in candidates.values()):
                continue
            for choice in itertools.product(*(_subsets(candidates[a]) for a in item.axes)):
                groups = dict(zip(item.axes, choice, strict=True))
                flat = [v for g in choice for v in g]
                if len(flat) != len(set(flat)):
                    continue
                outer = tuple(v for v in variables if v not in flat)
                utilization, cycles, bound = _estimate(form, target, item, groups, outer)
                found.append(
                    Mapping(
                        target.name,
                        item.name,
                        tuple((t, tensor_of[role_of[t]]) for t in ("a", "b", "c")),
                        tuple(groups.items()),
                        outer,
                        utilization,
                        cycles,
                        bound,
                    )
                )
    found.sort(key=lambda m: (m.cycles, -m.utilization, m.describe()))
    return found
