"""Where an op's points are stored, and the inner split of the depth-to-space family.

``Written`` says where each point of an op's domain is stored when that is not
the op's own output index: a loop-nest member computed at the main domain's
points and written through an inverse index map, or a member kept in a row
buffer.  ``split_inner`` rewrites an op whose innermost index ``w`` is read (or
written) only through ``w // m`` and ``w % m`` to run over ``w = m*q + r`` with
``r`` innermost: unit-stride accesses instead of a division and a gather per
point.  Both are pure index rewriting; ``targets.cpu.lower.Lowering`` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import sympy

from neoflow.ir import index
from neoflow.ir.bounds import PREFIX, lattice_condition
from neoflow.ir.expr import Expr, Index, Read, Reduce, map_children, map_indices
from neoflow.ir.op import Op
from neoflow.ir.simplify import simplify_index


@dataclass(frozen=True)
class Written:
    """Where a member written through an index map goes: ``target`` indexes its
    output (index expressions in the main indices), at the main points where
    the isl ``constraint`` holds for some value of the ``hidden`` variables."""

    target: tuple[sympy.Expr, ...]
    hidden: tuple[str, ...]
    constraint: str

    @property
    def where(self) -> str:
        """The isl constraint on the main points (``hidden`` existentially quantified)."""
        if not self.hidden:
            return self.constraint
        return f"exists ({', '.join(PREFIX + v for v in self.hidden)} : {self.constraint})"


def split_inner(member: Op, written: Written | None) -> tuple[Op, Written] | None:
    """``member`` with its innermost index ``w`` split as ``w = m*q + r`` (``r``
    innermost), when its reads (or where it is written) use ``w`` only through
    ``w // m`` and ``w % m`` besides plainly: the depth-to-space family.  Its
    inner loop then runs over ``q``, each of the ``m`` steps of ``r`` a unit-stride
    access, which the C compiler unrolls and vectorises; left alone, every point
    computes its ``w % m`` and gathers.  None when there is nothing to split."""
    if not member.indices:
        return None
    inner = member.indices[-1]
    w = index.var(inner)
    point = tuple(index.var(v) for v in member.indices)
    target = written.target if written is not None else point
    moduli = _moduli([*target, *_index_exprs(member.body)], w)
    extent = member.extent[inner]
    if len(moduli) != 1 or (m := moduli.pop()) < 2 or extent % m:
        return None
    taken = set(member.extent)
    q, r = index.fresh_name(f"{inner}_div{m}", taken), index.fresh_name(f"{inner}_mod{m}", taken)
    split = {w: m * index.var(q) + index.var(r)}
    indices = (*member.indices[:-1], q, r)
    ranges = tuple(zip(indices, (*(member.extent[v] for v in member.indices[:-1]), extent // m, m), strict=True))

    def at_split(expr: sympy.Expr) -> sympy.Expr:  # w // m is q and w % m is r over the new box
        return simplify_index(expr.xreplace(split), dict(ranges))

    op = replace(member, body=map_indices(member.body, at_split), indices=indices, ranges=ranges)
    hidden = (*(written.hidden if written is not None else ()), inner)
    constraint = f"{PREFIX}{inner} = {m}*{PREFIX}{q} + {PREFIX}{r}"
    if written is not None:
        constraint = f"{written.constraint} and {constraint}"
    return op, Written(tuple(at_split(e) for e in target), hidden, constraint)


def _index_exprs(body: Expr) -> list[sympy.Expr]:
    """Every index expression ``body`` uses: its reads' indices and its index values."""
    exprs: list[sympy.Expr] = []
    for node in body.walk():
        if isinstance(node, Read):
            exprs += node.indices
        elif isinstance(node, Index):
            exprs.append(node.expr)
    return exprs


def _moduli(exprs: list[sympy.Expr], w: sympy.Symbol) -> set[int]:
    """The ``m`` of every ``w // m`` and ``w % m`` in ``exprs``."""
    moduli = set()
    for expr in exprs:
        for atom in expr.atoms(sympy.floor, sympy.Mod):
            if w in atom.free_symbols:
                moduli.add(int(atom.args[1]) if isinstance(atom, sympy.Mod) else index.denominator(atom.args[0]))
    return moduli


def split_groups(op: Op) -> Op | None:
    """``op`` with each output index ``v`` its reads use through ``v // m`` (or ``v % m``) split as
    ``v = m*g + j`` in place (``g`` then ``j``, the output's shape split the same way, so that its
    memory layout is unchanged): a grouped convolution's ``X[n, k0 + 136*(i1//136), ...]`` becomes
    ``X[n, k0 + 136*g, ...]``, affine, a batch of ``G`` contractions for the blocked kernel instead of
    a loop nest dividing at every point.  None when no index is used so (or its extent is no multiple)."""
    if op.scatter is not None or not op.indices:
        return None
    reads = _index_exprs(op.body)
    indices, ranges, split = [], [], {}
    taken = set(op.extent)
    for v in op.indices:
        moduli = _moduli(reads, index.var(v))
        extent = op.extent[v]
        if len(moduli) == 1 and (m := next(iter(moduli))) >= 2 and extent % m == 0 and extent > m:
            g, j = index.fresh_name(f"{v}_group", taken), index.fresh_name(f"{v}_in_group", taken)
            taken |= {g, j}
            split[index.var(v)] = m * index.var(g) + index.var(j)
            indices += [g, j]
            ranges += [(g, extent // m), (j, m)]
        else:
            indices.append(v)
            ranges.append((v, extent))
    if not split:
        return None
    ranges += [(a, e) for a, e in op.ranges if a not in op.indices]  # the sums' axes
    box = dict(ranges)

    def at_split(expr: sympy.Expr) -> sympy.Expr:
        return simplify_index(expr.xreplace(split), box)

    body = map_indices(op.body, at_split)
    new = {s for value in split.values() for s in value.free_symbols}
    if any(atom.free_symbols & new for e in _index_exprs(body) for atom in e.atoms(sympy.floor, sympy.Mod)):
        return None  # a division the split does not resolve
    shape = tuple(e for v, e in ranges if v in indices)
    return replace(op, body=body, indices=tuple(indices), ranges=tuple(ranges), output=replace(op.output, shape=shape))


def radix_gather(op: Op) -> Op | None:
    """``op`` without its one sum where the sum has exactly one term at every point: its domain
    condition ``(z - c1*t1 - c2*t2 - ...) % M == 0`` over all its axes ``t``, whose coefficients are
    the digits' weights of a number below ``M`` (``t1`` below ``c2 / c1``, ..., the largest weight
    times its axis's extent ``M``), ``z`` an output index.  Each ``t`` is then ``z``'s digit: ``z``
    is split in place into ``M*a`` plus the digits (the output's layout unchanged), each axis read as
    its digit, each read affine.  A reshape's adjoint through a transpose (ViT's ``qkv`` split back
    into one tensor: ``(z - 16*h - d) % 64 == 0``) otherwise walked its two axes at every point with
    a division and a remainder a read.  None where ``op`` is no such sum."""
    found = _radix(op)
    if found is None:
        return None
    reduce, z, digits, modulus = found
    taken = set(op.extent)
    top = index.fresh_name(f"{z}_top", taken)
    names = [index.fresh_name(f"{z}_digit{k}", taken) for k in range(len(digits))]
    # the digits, heaviest first (row-major): z = M*top + sum of weight * digit
    order = sorted(range(len(digits)), key=lambda k: -digits[k][1])
    value = modulus * index.var(top) + sum(digits[k][1] * index.var(names[k]) for k in order)
    at = {index.var(z): value} | {index.var(digits[k][0]): index.var(names[k]) for k in range(len(digits))}
    position = op.indices.index(z)
    indices = (*op.indices[:position], top, *(names[k] for k in order), *op.indices[position + 1 :])
    extents = {v: e for v, e in op.ranges if v in op.indices} | {top: op.extent[z] // modulus}
    extents |= {names[k]: op.extent[digits[k][0]] for k in range(len(digits))}
    ranges = tuple((v, extents[v]) for v in indices)

    def digit(expr: sympy.Expr) -> sympy.Expr:
        return simplify_index(sympy.expand(expr.xreplace(at)), extents)

    def without_sum(node: Expr) -> Expr:
        return node.body if node is reduce else map_children(node, without_sum)

    body = map_indices(without_sum(op.body), digit)
    shape = tuple(extents[v] for v in indices)
    return replace(op, body=body, indices=indices, ranges=ranges, output=replace(op.output, shape=shape))


def _radix(op: Op) -> tuple[Reduce, str, list[tuple[str, int]], int] | None:
    """``(the sum, z, [(axis, weight)], M)`` for ``radix_gather``, else None."""
    if op.scatter is not None:
        return None
    sums = [n for n in op.body.walk() if isinstance(n, Reduce)]
    if len(sums) != 1 or sums[0].where is None or any(isinstance(n, Reduce) for n in sums[0].body.walk()):
        return None
    reduce = sums[0]
    found = lattice_condition(reduce.where)
    if found is None:
        return None
    expr, modulus = sympy.expand(found[0]), found[1]
    terms = index.linear_terms(expr)
    if terms is None or expr.xreplace({s: 0 for s in expr.free_symbols}) != 0:
        return None
    outputs = [v for v in op.indices if terms.get(v, 0) != 0]
    if len(outputs) != 1 or set(terms) - {outputs[0], *reduce.axes}:
        return None
    z = outputs[0]
    sign = terms[z]
    if sign not in (1, -1) or op.extent[z] % modulus:
        return None
    digits = [(t, int(-terms.get(t, 0) * sign)) for t in reduce.axes]
    weight = 1
    for t, c in sorted(digits, key=lambda d: d[1]):  # the weights: 1, then each times the last axis's extent
        if c != weight:
            return None
        weight *= op.extent[t]
    return (reduce, z, digits, modulus) if weight == modulus else None
