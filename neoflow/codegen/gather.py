"""Index tables for gathering a contraction's operands: the target-independent half of an implicit GEMM's loads.

An operand of a ``GemmView`` that reads tensors at an offset affine in the
view's row, depth and batch variables, separately (``row_part + depth_part +
rest``), is gathered through two tables: per row its offset part (and the row
variables its guards need), per depth the same.  Every target reads the same
tables: the CUDA kernels copy through them, the tensor-core model evaluates
them, the NPU compiler finds the GM footprint of a tile with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import sympy

from neoflow.codegen.implicit_gemm import GemmView
from neoflow.ir import index
from neoflow.ir.expr import Const, Expr, Read, Select, index_variables, map_children
from neoflow.ir.simplify import read_offset

#: the index variable holding a gathered element's flat offset (``Gather.expr`` reads at it)
OFFSET = "nf_off"


@dataclass(frozen=True)
class Gather:
    """How a kernel gathers an operand through index tables, where the operand reads
    ``tensors`` (one, or several of one shape read at the same indices, as a gradient and the
    activation masking it) at an affine offset ``row_part + depth_part + rest`` (row
    variables, depth variables, batch variables and the constant): a row table holds each
    row's ``row_part`` and the values of ``row_vars`` (the row variables the operand's
    guards use), a depth table each depth's ``depth_part`` and ``depth_vars``; ``expr`` is
    the operand reading each tensor flat (``flat``) at ``OFFSET``."""

    tensors: tuple[str, ...]
    row_part: sympy.Expr
    depth_part: sympy.Expr
    rest: sympy.Expr
    row_vars: tuple[str, ...]
    depth_vars: tuple[str, ...]
    expr: Expr

    @property
    def tensor(self) -> str:
        """The (first) tensor gathered."""
        return self.tensors[0]

    @staticmethod
    def flat(tensor: str) -> str:
        """The name ``expr`` reads ``tensor`` by, flat."""
        return f"{tensor}__flat"

    @property
    def plain(self) -> bool:
        """Whether the operand is the read itself or ``Select(guard, read, 0)`` (a padding or
        domain guard): a copy of the tensor's elements, zeros where the guard fails."""
        return isinstance(self.expr, Read) or self.guard is not None

    @property
    def guard(self) -> Expr | None:
        """The condition of a guarded read ``Select(guard, read, 0)``, else None."""
        expr = self.expr
        if isinstance(expr, Select) and isinstance(expr.a, Read) and isinstance(expr.b, Const) and expr.b.value == 0:
            return expr.cond
        return None


def gather_plan(view: GemmView, side: str) -> Gather | None:
    """The table gather of operand ``side`` (``a``: rows ``m``, ``b``: rows ``n``), or None where
    its reads are not tensors of one shape at the same affine offset (a data-dependent gather,
    a reshape's division, two different reads) or an offset reaches 2^31."""
    expr = view.a if side == "a" else view.b
    reads = expr.reads()
    if not reads:
        return None
    shapes = {t.name: t.shape for t in view.op.inputs}
    read = reads[0]
    if any(r.indices != read.indices or shapes[r.tensor] != shapes[read.tensor] for r in reads):
        return None
    if math.prod(shapes[read.tensor]) >= 1 << 31:
        return None
    offset = sympy.expand(read_offset(read.indices, shapes[read.tensor], view.op.extent))
    rows = [v for v, _ in (view.m if side == "a" else view.n)]
    depth = [v for v, _ in view.k]
    batch = [v for v, _ in view.batch]
    symbols = [index.var(v) for v in (*rows, *depth, *batch)]
    if offset.free_symbols - set(symbols) or not offset.is_polynomial(*symbols):
        return None
    if any(sympy.degree(offset, s) > 1 for s in symbols):
        return None
    terms = sympy.Add.make_args(offset)

    def part(names: list[str]) -> sympy.Expr:
        wanted = {index.var(v) for v in names}
        return sympy.Add(*(t for t in terms if t.free_symbols and t.free_symbols <= wanted))

    row_part, depth_part = part(rows), part(depth)
    rest = sympy.expand(offset - row_part - depth_part)
    if rest.free_symbols - {index.var(v) for v in batch}:
        return None  # a term mixing rows and depth: not affine in the two apart
    tensors = tuple(dict.fromkeys(r.tensor for r in reads))

    def flat_read(node: Read) -> Read:
        return Read(Gather.flat(node.tensor), (index.var(OFFSET),), node.tensor_dtype)

    replaced = map_reads(expr, flat_read)
    guards = index_variables(map_reads(expr, lambda node: Const(0.0)))
    return Gather(
        tensors,
        row_part,
        depth_part,
        rest,
        tuple(v for v in rows if v in guards),
        tuple(v for v in depth if v in guards),
        replaced,
    )


def map_reads(node: Expr, change) -> Expr:
    """``node`` with every read replaced by ``change(read)``."""
    if isinstance(node, Read):
        return change(node)
    return map_children(node, lambda child: map_reads(child, change))


def unravel(flat: np.ndarray, axis) -> dict[str, np.ndarray]:
    """Row-major values of the variables of ``axis`` (``((name, extent), ...)``) at flat indices ``flat``."""
    out, rest = {}, flat
    for name, extent in reversed(axis):
        out[name] = rest % extent
        rest = rest // extent
    return out


@lru_cache(maxsize=256)
def gather_tables(view: GemmView, side: str, gather: Gather) -> tuple[np.ndarray, np.ndarray]:
    """The row table ``[rows, 1 + len(row_vars)]`` and depth table ``[K, 1 + len(depth_vars)]``
    (int32: the offset part, then the guard variables' values) of ``gather``; read-only, built
    once per operand (every tile and load order a plan weighs shares them)."""
    axis = view.m if side == "a" else view.n
    tables = []
    for variables, part, names in (
        (axis, gather.row_part, gather.row_vars),
        (view.k, gather.depth_part, gather.depth_vars),
    ):
        count = math.prod(e for _, e in variables)
        env = unravel(np.arange(count, dtype=np.int64), variables)
        columns = [np.broadcast_to(np.asarray(index.evaluate(part, env), dtype=np.int64), (count,))]
        columns += [env[v] for v in names]
        table = np.ascontiguousarray(np.stack(columns, axis=1).astype(np.int32))
        table.flags.writeable = False
        tables.append(table)
    return tables[0], tables[1]
