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
from neoflow.ir.bounds import PREFIX
from neoflow.ir.expr import Index, Read, map_indices
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
    exprs = [*target]
    for node in member.body.walk():
        if isinstance(node, Read):
            exprs += node.indices
        elif isinstance(node, Index):
            exprs.append(node.expr)
    moduli = set()
    for expr in exprs:
        for atom in expr.atoms(sympy.floor, sympy.Mod):
            if w in atom.free_symbols:
                moduli.add(int(atom.args[1]) if isinstance(atom, sympy.Mod) else index.denominator(atom.args[0]))
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
