"""Adjoint ops in gather form, derived from an op's expression.

For ``Out[x] = F_r(... A[f(x, r)] ...)`` the adjoint of ``A`` is

    dA[z] = sum over reads of A:  ReduceAdd({t | conditions}, dOut[x(z, t)] * factor(z, t))

where ``(x, r) = (x(z, t), r(z, t))`` solves ``f(x, r) = z``
(``neoflow.autodiff.solve``), ``t`` are the solution's free variables, and the
conditions (forward box, ``Select`` guards, lattice conditions) are simplified
by isl against the new box.  The resulting reduction enumerates exactly the
``(z, t)`` pairs that correspond to forward terms, which ``AdjointInfo.waste``
checks by counting isl points.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import sympy

from neoflow.autodiff.paths import Occurrence, occurrences
from neoflow.autodiff.solve import NotAffine, Solution, solve
from neoflow.autodiff.symbolic import simplify
from neoflow.errors import NeoflowError, NonInvertibleMapError
from neoflow.ir import bounds, index
from neoflow.ir.build import make_op
from neoflow.ir.expr import (
    Binary,
    Const,
    Expr,
    Index,
    Read,
    Reduce,
    Select,
    bound_variables,
    conjuncts,
    map_children,
    map_indices,
)
from neoflow.ir.factor import hoist_invariant_factors
from neoflow.ir.op import Op, Tensor
from neoflow.ir.printer import to_text
from neoflow.ir.simplify import interval


@dataclass
class AdjointInfo:
    """What autodiff knows about an adjoint op: which op and input it differentiates,
    whether it is a gather or a scatter, its new reduction axes, and the isl sets
    it enumerates versus the forward terms they stand for (for ``waste``)."""

    forward: str
    wrt: str
    kind: str  # "gather" or "scatter"
    new_axes: tuple[tuple[str, int], ...]
    reason: str = ""  # why a scatter was needed
    enumerated: list[tuple[list[str], str]] = field(default_factory=list)
    forward_terms: list[tuple[list[str], str]] = field(default_factory=list)

    @cached_property
    def waste(self) -> float:
        """Fraction of enumerated (output point, reduction point) pairs that
        correspond to no forward term, counted with isl."""
        enumerated = sum(_count(v, c) for v, c in self.enumerated)
        useful = sum(_count(v, c) for v, c in self.forward_terms)
        return 0.0 if enumerated == 0 else 1.0 - useful / enumerated


def _count(variables: list[str], constraint: str) -> int:
    return int(bounds.make_set(variables, constraint).count_val().to_python())


def _condition_text(conditions: Sequence[Expr]) -> str:
    parts = [bounds.condition_to_isl(c, True) for c in conditions]
    return " and ".join(f"({p})" for p in parts if p is not None) or "1 = 1"


def _conjunction(conditions: Sequence[Expr]) -> Expr | None:
    out: Expr | None = None
    for cond in conditions:
        out = cond if out is None else Binary("&&", out, cond)
    return out


def _rename_bound(node: Expr, avoid: set[str], taken: set[str]) -> Expr:
    """Rename reduction axes of ``node`` that clash with ``avoid``."""
    clashes = bound_variables(node) & avoid
    for name in sorted(clashes):
        new = index.fresh_name(name, taken)
        node = _rename_axis(node, name, new)
    return node


def _rename_axis(node: Expr, old: str, new: str) -> Expr:
    mapping = {index.var(old): index.var(new)}
    if isinstance(node, Reduce) and old in node.axes:
        axes = tuple(new if a == old else a for a in node.axes)
        where = None if node.where is None else map_indices(node.where, lambda e: e.xreplace(mapping))
        return Reduce(node.kind, axes, node.extents, map_indices(node.body, lambda e: e.xreplace(mapping)), where)
    if isinstance(node, Reduce):
        where = None if node.where is None else _rename_axis(node.where, old, new)
        return Reduce(node.kind, node.axes, node.extents, _rename_axis(node.body, old, new), where)
    return map_children(node, lambda child: _rename_axis(child, old, new))


@dataclass
class _Term:
    occurrence: Occurrence
    solution: Solution


class _AdjointBuilder:
    def __init__(self, op: Op, wrt: str) -> None:
        self.op = op
        self.wrt = wrt
        self.target = op.input(wrt)
        self.taken = set(op.extent) | {t.name for t in op.inputs} | {op.name, f"d{op.name}"}
        self.info = AdjointInfo(op.name, wrt, "gather", ())

    def fail(self, read: Read, why: str) -> NonInvertibleMapError:
        text = f"{read.tensor}[{', '.join(index.to_text(i) for i in read.indices)}]"
        return NonInvertibleMapError(f"cannot invert the index map of read {text}: {why}", op=self.op.name)

    def build(self) -> Op:
        terms: list[_Term] = []
        found = occurrences(self.op, self.wrt)
        for occ in found:
            try:
                terms.append(_Term(occ, solve(occ.read, occ.variables, self.op.indices, self.op.extent, self.taken)))
            except NotAffine as err:
                if len(found) > 1:
                    raise self.fail(
                        occ.read, f"{err}, and a scatter-add fallback needs it to be the only read of '{self.wrt}'"
                    ) from None
                return self.scatter(occ, str(err))
        names = self.output_names(terms)
        exprs: list[Expr] = []
        new_axes: dict[str, int] = {}
        for term in terms:
            built = self.term(term, names)
            if built is not None:
                expr, axes = built
                exprs.append(expr)
                new_axes.update(axes)
        body = hoist_invariant_factors(_merge(exprs)) if exprs else Const(0)
        self.info.new_axes = tuple(new_axes.items())
        try:
            adjoint = make_op(f"d{self.wrt}", names, body, self.tensors(), self.target.shape, self.target.dtype)
        except NeoflowError as err:  # a bug in the derivation, not in the user's op
            raise NonInvertibleMapError(
                f"derived adjoint of '{self.wrt}' is invalid ({err.message}): {to_text(body)}", op=self.op.name
            ) from None
        return dataclasses.replace(adjoint, info=self.info)

    def tensors(self) -> dict[str, Tensor]:
        """What an adjoint may read: the forward inputs and output, and ``d<output>``."""
        tensors = {t.name: t for t in self.op.inputs}
        tensors[f"d{self.op.name}"] = Tensor(f"d{self.op.name}", self.op.shape, self.op.dtype)
        tensors[self.op.name] = self.op.output
        return tensors

    def scatter(self, occ: Occurrence, why: str) -> Op:
        """``dA[f(v)] += dOut[x] * factor`` over the forward points: the fallback for
        an index map that is not affine."""
        op = self.op
        body: Expr = Read(f"d{op.name}", tuple(index.var(x) for x in op.indices), op.dtype)
        if occ.factor is not None:
            body = Binary("*", body, occ.factor)
        guard = _conjunction(occ.guards)
        if guard is not None:
            body = Select(guard, body, Const(0))
        extents = {v: op.extent[v] for v in occ.variables}
        self.info.kind = "scatter"
        self.info.reason = why
        domain = (list(occ.variables), _and_text(bounds.box_constraint(extents), _condition_text(occ.guards)))
        self.info.enumerated.append(domain)
        self.info.forward_terms.append(domain)
        adjoint = make_op(
            f"d{self.wrt}",
            occ.variables,
            body,
            self.tensors(),
            None,
            self.target.dtype,
            scatter=(occ.read.indices, self.target.shape),
            given=extents,
        )
        return dataclasses.replace(adjoint, info=self.info)

    def output_names(self, terms: list[_Term]) -> list[str]:
        """Names of the adjoint's output indices: the forward variable a dimension
        is indexed by directly where that works, else ``z1, z2, ...``."""
        rank = len(self.target.shape)
        names: list[str | None] = [None] * rank
        free = {name for term in terms for name in term.solution.free}
        used: set[str] = set()
        for d in range(rank):
            for term in terms:
                z = term.solution.z[d]
                candidates = [s.name for s, e in term.solution.substitution.items() if e == z and s.name not in free]
                if candidates and candidates[0] not in used:
                    names[d] = candidates[0]
                    used.add(candidates[0])
                    break
        for d in range(rank):
            if names[d] is None:
                names[d] = index.fresh_name(f"z{d + 1}", self.taken | used | free)
                used.add(names[d])
        return [n for n in names if n is not None]

    def term(self, term: _Term, names: list[str]) -> tuple[Expr, dict[str, int]] | None:
        op, occ, sol = self.op, term.occurrence, term.solution
        zmap = {z: index.var(name) for z, name in zip(sol.z, names, strict=True)}
        free = list(sol.free)
        rename = {}
        for i, name in enumerate(free):
            if name in names:
                new = index.fresh_name(name, self.taken | set(names))
                rename[index.var(name)] = index.var(new)
                free[i] = new

        def apply(expr: sympy.Expr) -> sympy.Expr:
            return sympy.expand(sol.apply(expr).xreplace(zmap).xreplace(rename)) if expr.free_symbols else expr

        extents = {**op.extent, **sol.extents}
        for old, new in rename.items():
            extents[new.name] = extents[old.name]
        conditions = [map_indices(c, lambda e: e.xreplace(zmap).xreplace(rename)) for c in sol.conditions]
        for name in [*occ.variables, *sol.new_variables]:
            value = apply(index.var(name))
            # also where the value is the variable itself: the target's index of that name may range
            # wider than the op's (a Split's first part reads h[i0, i1] with i1 < 8 of h's 24); the
            # conditions the new box implies are dropped below
            if name in extents and not (value.is_Symbol and value.name in free):
                conditions.append(Binary(">=", _index(value), Const(0)))
                conditions.append(Binary("<", _index(value), Const(extents[name])))
        conditions += [map_indices(g, apply) for guard in occ.guards for g in conjuncts(guard)]
        avoid = set(names) | set(free) | set(occ.variables)
        factor = None if occ.factor is None else map_indices(_rename_bound(occ.factor, avoid, self.taken), apply)
        dout = Read(f"d{op.name}", tuple(apply(index.var(x)) for x in op.indices), op.dtype)
        body: Expr = dout if factor is None else Binary("*", dout, factor)

        box = dict(zip(names, self.target.shape, strict=True))
        free_extents = {t: extents.get(t) for t in free}
        domain = bounds.make_set(
            [*names, *free], _and_text(bounds.box_constraint({**box, **free_extents}), _condition_text(conditions))
        )
        if domain.is_empty():
            return None
        for i, t in enumerate(free):
            lo = int(domain.dim_min(len(names) + i).get_pieces()[0][1].get_constant_val().to_python())
            hi = int(domain.dim_max(len(names) + i).get_pieces()[0][1].get_constant_val().to_python())
            if lo < 0:
                shift = {index.var(t): index.var(t) + lo}
                body = map_indices(body, lambda e, s=shift: sympy.expand(e.xreplace(s)))
                conditions = [map_indices(c, lambda e, s=shift: sympy.expand(e.xreplace(s))) for c in conditions]
                hi -= lo
            free_extents[t] = hi + 1 if free_extents[t] is None or lo < 0 else free_extents[t]
        conditions = [_tidy(c) for c in _drop_implied(conditions, [*names, *free], {**box, **free_extents})]
        self.info.enumerated.append(
            ([*names, *free], _and_text(bounds.box_constraint({**box, **free_extents}), _condition_text(conditions)))
        )
        scope_extents = {v: op.extent[v] for v in occ.variables}
        self.info.forward_terms.append(
            (list(occ.variables), _and_text(bounds.box_constraint(scope_extents), _condition_text(occ.guards)))
        )
        free, body, conditions = _pinned(list(free), {**box, **free_extents}, body, conditions)
        where = _conjunction(conditions)
        if not free:
            return (body if where is None else Select(where, body, Const(0))), {}
        direct = {str(i) for r in body.reads() for i in r.indices if i.is_Symbol}
        reduce = Reduce(
            "ReduceAdd",
            tuple(free),
            tuple(None if t in direct and t in op.extent else free_extents[t] for t in free),
            body,
            where,
        )
        return reduce, {t: free_extents[t] for t in free}


def _affine(expr: sympy.Expr) -> bool:
    """Whether ``expr`` is affine in its variables (no floor, remainder or product of two)."""
    if not expr.free_symbols:
        return True
    return expr.is_polynomial() and sympy.Poly(expr, *expr.free_symbols).total_degree() <= 1


def _pin(free: list[str], extents: dict[str, int], conditions: list[Expr]) -> tuple[str, int, sympy.Expr, int] | None:
    """The first reduction variable of ``free`` a lattice condition pins to one value: ``(variable,
    the condition's position, its value, the value's greatest)`` for ``(t + e) % m == 0`` where ``t``
    ranges over at most ``m`` values and ``-e`` is affine and stays in ``[0, m)``; None where there is
    none."""
    for t in free:
        symbol = index.var(t)
        for position, condition in enumerate(conditions):
            found = bounds.lattice_condition(condition)
            if found is None or extents.get(t) is None or extents[t] > found[1]:
                continue
            expr, modulus = sympy.expand(found[0]), found[1]
            coefficient = index.coefficient(expr, t)
            value = sympy.expand(coefficient * symbol - expr) * coefficient  # t = value (mod m)
            if coefficient not in (1, -1) or symbol in value.free_symbols or not _affine(value):
                continue
            span = interval(value, extents)
            # where -e leaves [0, m), t = -e % m: a pooling's window offset, a Mod in every index (it cost
            # the NPU's vector unit its runs, cnn.onnx's pooling adjoint 2755 -> 8771 cycles): t stays
            if span is not None and span[0] >= 0 and span[1] < modulus:
                return t, position, value, int(span[1])
    return None


def _pinned(
    free: list[str], extents: dict[str, int], body: Expr, conditions: list[Expr]
) -> tuple[list[str], Expr, list[Expr]]:
    """``free`` without the reduction variables a lattice condition pins to one value (``_pin``),
    substituted in ``body`` and ``conditions`` (with the value kept below ``t``'s extent).  A reshape's
    adjoint read back through a flattening is such a sum: 576 x 48 masked terms a point, one of them
    alive (capsule28's ``grad_c2``), where no change of variables splits it into pieces."""
    while (found := _pin(free, extents, conditions)) is not None:
        t, position, value, greatest = found
        mapping = {index.var(t): value}
        body = map_indices(body, lambda e, mapping=mapping: sympy.expand(e.xreplace(mapping)))
        kept = [c for k, c in enumerate(conditions) if k != position]
        conditions = [map_indices(c, lambda e, mapping=mapping: e.xreplace(mapping)) for c in kept]
        if greatest >= extents[t]:
            conditions.append(Binary("<", _index(value), Const(extents[t])))
        free = [f for f in free if f != t]
    return free, body, conditions


def _tidy(cond: Expr) -> Expr:
    """``z3 + 2 > 2`` becomes ``z3 > 0``: constants move to the right-hand side."""
    if isinstance(cond, Binary) and cond.op in ("<", "<=", ">", ">=", "==", "!=") and isinstance(cond.b, Const):
        left = cond.a.expr if hasattr(cond.a, "expr") else None
        if left is not None and not isinstance(cond.b.value, bool):
            constant = left.as_coeff_Add()[0]
            if constant != 0 and constant.is_Integer:
                return Binary(cond.op, _index(left - constant), Const(cond.b.value - int(constant)))
    return cond


def _index(expr: sympy.Expr) -> Expr:
    return Const(int(expr)) if expr.is_Integer else Index(expr)


def _and_text(a: str, b: str) -> str:
    return f"({a}) and ({b})"


def _drop_implied(conditions: list[Expr], variables: list[str], box: dict[str, int]) -> list[Expr]:
    """Remove conditions that the box and the remaining conditions imply."""
    kept = list(conditions)
    box_text = bounds.box_constraint(box)
    for cond in list(conditions):
        text = bounds.condition_to_isl(cond, True)
        if text is None:
            continue
        others = [c for c in kept if c is not cond]
        region = bounds.make_set(variables, _and_text(box_text, _condition_text(others)))
        if region.is_subset(bounds.make_set(variables, text)):
            kept = others
    return kept


def _merge(exprs: list[Expr]) -> Expr:
    """Sum the terms; reductions over the same axes and domain share one reduction."""
    merged: list[Expr] = []
    for expr in exprs:
        for i, other in enumerate(merged):
            if (
                isinstance(expr, Reduce)
                and isinstance(other, Reduce)
                and (expr.axes, expr.extents, expr.where) == (other.axes, other.extents, other.where)
            ):
                merged[i] = Reduce(
                    "ReduceAdd", expr.axes, expr.extents, simplify(Binary("+", other.body, expr.body)), expr.where
                )
                break
            if not isinstance(expr, Reduce) and not isinstance(other, Reduce):
                merged[i] = simplify(Binary("+", other, expr))
                break
        else:
            merged.append(expr)
    out = merged[0]
    for expr in merged[1:]:
        out = Binary("+", out, expr)
    return out


def adjoint(op: Op, wrt: str) -> Op:
    """The adjoint op of input ``wrt`` of ``op`` (named ``d<wrt>``; it reads
    ``d<op.name>``).  Its ``info`` attribute is an ``AdjointInfo``."""
    try:
        return _AdjointBuilder(op, wrt).build()
    except NeoflowError:
        raise
    except Exception as err:  # sympy/isl failures become an autodiff error naming the op and input
        raise NonInvertibleMapError(
            f"cannot derive the adjoint of '{wrt}': {type(err).__name__}: {err}", op=op.name
        ) from err
