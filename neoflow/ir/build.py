"""From parse tree to IR: name resolution, implicit reductions, dtypes and ranges.

Rules of the language (see also ``neoflow.ir.syntax``):

* A name followed by ``[`` is a tensor; every other name is an index variable
  (``true``, ``false``, ``inf`` and ``nan`` are literals).
* A variable on the right that is neither an output index nor listed by an
  enclosing reduction is an extra axis of the innermost reduction that encloses
  all its uses (the seed's ``D`` lists ``{r, s}`` and also reduces ``c``).  With
  ``+=`` and no such reduction, the statement sums over it.
* Inside brackets, and wherever an expression uses only variables, integer
  literals and ``+ - * / // %``, it is an integer index expression: ``/`` is
  floor division there, and divisors and moduli must be positive constants.
* A variable's extent comes from the text (``{r: 3}``) or the output shape when
  given; else from a tensor dimension it indexes directly.  All direct uses of a
  variable must agree (for output indices, those outside any ``Select``).
  Output variables left over get the largest extent for which every read stays
  in bounds (isl).  Finally every read is checked to stay in bounds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import sympy

from neoflow.errors import ParseError, ShapeError
from neoflow.ir import bounds, index
from neoflow.ir import dtypes as dt
from neoflow.ir.expr import (
    BINARY_FUNCTIONS,
    REDUCTIONS,
    UNARY_FUNCTIONS,
    Binary,
    Cast,
    Const,
    Expr,
    Index,
    Read,
    Reduce,
    Select,
    Unary,
    map_indices,
)
from neoflow.ir.op import Op, Tensor, given_shape
from neoflow.ir.simplify import simplify_index
from neoflow.ir.syntax import (
    Assign,
    AxisSet,
    BinOp,
    Call,
    Declare,
    Name,
    Node,
    Number,
    Pos,
    Subscript,
    UnOp,
)

LITERALS: dict[str, bool | float] = {"true": True, "false": False, "inf": float("inf"), "nan": float("nan")}
_INDEX_OPS = ("+", "-", "*", "/", "//", "%")


def _literal(node: Node) -> bool:
    """Whether ``node`` is made of number literals alone (``3``, ``-(2 * 4)``)."""
    if isinstance(node, Number):
        return True
    if isinstance(node, UnOp):
        return node.op == "-" and _literal(node.x)
    return isinstance(node, BinOp) and _literal(node.a) and _literal(node.b)


def _error(cls: type[ParseError] | type[ShapeError], message: str, pos: Pos | None, op: str) -> Exception:
    return cls(message, op=op, line=pos[0] if pos else None, column=pos[1] if pos else None)


@dataclass
class _Scope:
    """What pass 1 learns about the variables of one statement."""

    outputs: tuple[str, ...]
    explicit: dict[int, list[tuple[str, int | None, Pos]]] = field(default_factory=dict)
    implicit: dict[int, list[str]] = field(default_factory=dict)  # reduce id (-1: the += sum) -> axes
    first_use: dict[str, Pos] = field(default_factory=dict)


class _OpBuilder:
    def __init__(
        self,
        stmt: Assign,
        tensors: Mapping[str, Tensor],
        out_shape: Sequence[int] | None,
        out_dtype: str | None,
        default_dtype: str,
    ) -> None:
        self.stmt = stmt
        self.name = stmt.target.name
        self.tensors = tensors
        self.out_shape = tuple(out_shape) if out_shape is not None else None
        self.out_dtype = out_dtype
        self.default_dtype = default_dtype
        self.read_pos: dict[Read, Pos] = {}
        self.parents: dict[int, tuple[int, ...]] = {}
        self.scope = _Scope(self._output_indices())
        for arg in stmt.target.args:
            if isinstance(arg, Name):
                self.scope.first_use[arg.name] = arg.pos

    def fail(self, message: str, pos: Pos | None, cls: type = ParseError) -> Exception:
        return _error(cls, message, pos, self.name)

    # -- pass 1: which names are variables, and which reduction owns each ----

    def _output_indices(self) -> tuple[str, ...]:
        names: list[str] = []
        self.scatter = self.stmt.accumulate and not all(
            isinstance(arg, Name) and arg.name not in LITERALS for arg in self.stmt.target.args
        )
        if self.scatter:
            if self.out_shape is None:
                raise self.fail(
                    f"a scatter-add into '{self.name}' needs the shape of '{self.name}'",
                    self.stmt.target.pos,
                    ShapeError,
                )
            if len(self.out_shape) != len(self.stmt.target.args):
                raise self.fail(
                    f"'{self.name}' has {len(self.out_shape)} dimensions but is written with "
                    f"{len(self.stmt.target.args)} indices",
                    self.stmt.target.pos,
                    ShapeError,
                )
            return ()  # the iteration variables are the statement's free variables
        for arg in self.stmt.target.args:
            if not isinstance(arg, Name) or arg.name in LITERALS:
                raise self.fail("output indices must be plain variable names", arg.pos)
            if arg.name in names:
                raise self.fail(f"output index '{arg.name}' appears twice", arg.pos, ShapeError)
            if arg.name in self.tensors:
                raise self.fail(f"'{arg.name}' is a tensor and cannot be an index variable", arg.pos)
            names.append(arg.name)
        if self.out_shape is not None and len(self.out_shape) != len(names):
            raise self.fail(
                f"'{self.name}' has {len(self.out_shape)} dimensions but is written with {len(names)} indices",
                self.stmt.target.pos,
                ShapeError,
            )
        return tuple(names)

    def _scan(
        self,
        node: Node,
        stack: tuple[int, ...],
        bound: frozenset[str],
        uses: dict[str, list[tuple[tuple[int, ...], Pos]]],
    ) -> None:
        if isinstance(node, Name):
            if node.name in LITERALS:
                return
            if node.name in self.tensors:
                raise self.fail(f"tensor '{node.name}' is used without indices", node.pos)
            self.scope.first_use.setdefault(node.name, node.pos)
            if node.name not in bound:
                uses.setdefault(node.name, []).append((stack, node.pos))
            return
        if isinstance(node, Call) and node.func in REDUCTIONS:
            if len(node.args) != 2 or not isinstance(node.args[0], AxisSet):
                raise self.fail(f"{node.func} takes an axis set and a body: {node.func}({{r, s}}, ...)", node.pos)
            axes = list(node.args[0].axes)
            for axis, _extent, pos in axes:
                if axis in bound:
                    what = "an output index" if axis in self.scope.outputs else "reduced by an enclosing reduction"
                    raise self.fail(f"variable '{axis}' is ambiguous: it is already {what}", pos, ShapeError)
                if axis in self.tensors or axis in LITERALS:
                    raise self.fail(f"'{axis}' cannot be a reduction axis (it is a tensor or a literal)", pos)
                if [a for a, _, _ in axes].count(axis) > 1:
                    raise self.fail(f"reduction axis '{axis}' is listed twice", pos, ShapeError)
                self.scope.first_use.setdefault(axis, pos)
            reduce_id = len(self.scope.explicit)
            self.scope.explicit[reduce_id] = axes
            self.parents[reduce_id] = stack
            inner = bound | {a for a, _, _ in axes}
            if node.args[0].where is not None:
                self._scan(node.args[0].where, (*stack, reduce_id), inner, uses)
            self._scan(node.args[1], (*stack, reduce_id), inner, uses)
            return
        if isinstance(node, AxisSet):
            raise self.fail("an axis set {...} is only allowed as the first argument of a reduction", node.pos)
        for child in _children(node):
            self._scan(child, stack, bound, uses)

    def analyse_scopes(self) -> None:
        uses: dict[str, list[tuple[tuple[int, ...], Pos]]] = {}
        self._scan(self.stmt.value, (), frozenset(self.scope.outputs), uses)
        for name, occurrences in uses.items():
            common = list(occurrences[0][0])
            for stack, _ in occurrences[1:]:
                n = 0
                while n < min(len(common), len(stack)) and common[n] == stack[n]:
                    n += 1
                del common[n:]
            if common:
                self.scope.implicit.setdefault(common[-1], []).append(name)
            elif self.stmt.accumulate:
                self.scope.implicit.setdefault(-1, []).append(name)
            else:
                raise self.fail(
                    f"variable '{name}' is not an output index and no reduction encloses all its uses "
                    f"(list it in a reduction such as ReduceAdd({{{name}}}, ...) or write '+=')",
                    occurrences[0][1],
                    ShapeError,
                )
        owners: dict[str, list[int]] = {}
        for reduce_id in sorted({*self.scope.explicit, *self.scope.implicit}):
            axes = [a for a, _, _ in self.scope.explicit.get(reduce_id, [])] + self.scope.implicit.get(reduce_id, [])
            for axis in axes:
                for other in owners.get(axis, []):
                    if other in self.parents.get(reduce_id, ()) or reduce_id in self.parents.get(other, ()):
                        raise self.fail(
                            f"variable '{axis}' is ambiguous: a reduction over it is nested in another one; rename one",
                            self.scope.first_use.get(axis),
                            ShapeError,
                        )
                owners.setdefault(axis, []).append(reduce_id)

    # -- pass 2: IR ----------------------------------------------------------

    def tensor(self, name: str, pos: Pos, rank: int) -> Tensor:
        if name == self.name:
            raise self.fail(f"op '{name}' reads its own output", pos, ShapeError)
        if name not in self.tensors:
            raise self.fail(f"unknown tensor '{name}' (give its shape)", pos)
        tensor = self.tensors[name]
        if len(tensor.shape) != rank:
            raise self.fail(
                f"wrong number of indices for '{name}': it has {len(tensor.shape)} dimensions, {rank} given",
                pos,
                ShapeError,
            )
        return tensor

    def index_expr(self, node: Node) -> sympy.Expr:
        if isinstance(node, Number):
            if isinstance(node.value, float):
                raise self.fail(f"index {node.value} is not an integer", node.pos)
            return index.const(node.value)
        if isinstance(node, Name):
            if node.name in LITERALS:
                raise self.fail(f"'{node.name}' is not an integer index", node.pos)
            return index.var(node.name)
        if isinstance(node, Subscript):
            tensor = self.tensor(node.name, node.pos, len(node.args))
            if dt.is_float(tensor.dtype) or tensor.dtype == "bool":
                raise self.fail(
                    f"'{node.name}' ({tensor.dtype}) cannot be used as an index: only integer tensors can", node.pos
                )
            return index.tensor_read(node.name, tuple(self.index_expr(a) for a in node.args))
        if isinstance(node, UnOp) and node.op == "-":
            return -self.index_expr(node.x)
        if isinstance(node, BinOp) and node.op in _INDEX_OPS:
            a, b = self.index_expr(node.a), self.index_expr(node.b)
            if node.op == "+":
                return a + b
            if node.op == "-":
                return a - b
            if node.op == "*":
                return a * b
            if not (b.is_Integer and b > 0):
                raise self.fail(f"'{node.op}' in an index needs a positive integer constant on its right", node.pos)
            return index.mod(a, b) if node.op == "%" else index.floordiv(a, b)
        raise self.fail("expected an integer index expression (variables, integers, + - * / // %)", node.pos)

    def is_index(self, node: Node) -> bool:
        """Whether a value is an integer index expression (folded as one, ``/`` flooring).  A ``/``
        between literals alone is not: ``1 / 3`` is a third, as in Python, not 0."""
        if isinstance(node, Number):
            return isinstance(node.value, int)
        if isinstance(node, Name):
            return node.name not in LITERALS
        if isinstance(node, UnOp):
            return node.op == "-" and self.is_index(node.x)
        if isinstance(node, BinOp):
            if node.op == "/" and _literal(node.a) and _literal(node.b):
                return False
            return node.op in _INDEX_OPS and self.is_index(node.a) and self.is_index(node.b)
        return False

    def value(self, node: Node) -> Expr:
        if isinstance(node, Number):
            return Const(node.value)
        if isinstance(node, Name) and node.name in LITERALS:
            return Const(LITERALS[node.name])
        if self.is_index(node):
            expr = self.index_expr(node)
            return Const(int(expr)) if expr.is_Integer else Index(expr)
        if isinstance(node, Subscript):
            tensor = self.tensor(node.name, node.pos, len(node.args))
            read = Read(node.name, tuple(self.index_expr(a) for a in node.args), tensor.dtype)
            self.read_pos.setdefault(read, node.pos)
            return read
        if isinstance(node, UnOp):
            x = self.value(node.x)
            if node.op == "-" and isinstance(x, Const) and not isinstance(x.value, bool):
                return Const(-x.value)
            return Unary(node.op, x)
        if isinstance(node, BinOp):
            return Binary(node.op, self.value(node.a), self.value(node.b))
        if isinstance(node, Call):
            return self.call(node)
        raise self.fail("an axis set {...} is only allowed as the first argument of a reduction", node.pos)

    def call(self, node: Call) -> Expr:
        func, args = node.func, node.args

        def arity(n: int) -> None:
            if len(args) != n:
                raise self.fail(f"{func} takes {n} argument{'s' if n > 1 else ''}, {len(args)} given", node.pos)

        if func == "Select":
            arity(3)
            return Select(self.value(args[0]), self.value(args[1]), self.value(args[2]))
        if func in REDUCTIONS:
            reduce_id = self._next_reduce
            self._next_reduce += 1
            listed = self.scope.explicit[reduce_id]
            extra = self.scope.implicit.get(reduce_id, [])
            axes = tuple([a for a, _, _ in listed] + extra)
            extents = tuple([e for _, e, _ in listed] + [None] * len(extra))
            where = args[0].where
            return Reduce(func, axes, extents, self.value(args[1]), None if where is None else self.value(where))
        if func in UNARY_FUNCTIONS:
            arity(1)
            return Unary(func, self.value(args[0]))
        if func in BINARY_FUNCTIONS:
            arity(2)
            return Binary(func, self.value(args[0]), self.value(args[1]))
        if func in dt.DTYPES:
            arity(1)
            return Cast(func, self.value(args[0]))
        known = ", ".join(("Select", *REDUCTIONS, *UNARY_FUNCTIONS, *BINARY_FUNCTIONS, *dt.DTYPES))
        raise self.fail(f"unknown function '{func}' (known: {known})", node.pos)

    def body(self) -> Expr:
        self.analyse_scopes()
        self._next_reduce = 0
        body = self.value(self.stmt.value)
        top = self.scope.implicit.get(-1, [])
        if top:
            body = Reduce("ReduceAdd", tuple(top), (None,) * len(top), body)
        return body

    def build(self) -> Op:
        if self.scatter:
            return self.build_scatter()
        body = self.body()
        return make_op(
            self.name,
            self.scope.outputs,
            body,
            self.tensors,
            self.out_shape,
            self.out_dtype,
            self.default_dtype,
            self.read_pos,
            self.scope.first_use,
        )

    def build_scatter(self) -> Op:
        """``Out[f(v)] += body(v)``: every free variable ``v`` is iterated over."""
        uses: dict[str, list[tuple[tuple[int, ...], Pos]]] = {}
        for arg in self.stmt.target.args:
            self._scan(arg, (), frozenset(), uses)
        self._scan(self.stmt.value, (), frozenset(), uses)
        self.scope = _Scope(tuple(uses), first_use={name: where[0][1] for name, where in uses.items()})
        self.parents = {}
        self.analyse_scopes()
        self._next_reduce = 0
        body = self.value(self.stmt.value)
        target = tuple(self.index_expr(arg) for arg in self.stmt.target.args)
        return make_op(
            self.name,
            self.scope.outputs,
            body,
            self.tensors,
            None,
            self.out_dtype,
            self.default_dtype,
            self.read_pos,
            self.scope.first_use,
            scatter=(target, self.out_shape),
        )


def infer_ranges(
    op_name: str,
    indices: Sequence[str],
    body: Expr,
    tensors: Mapping[str, Tensor],
    out_shape: Sequence[int] | None = None,
    read_pos: Mapping[Read, Pos] | None = None,
    var_pos: Mapping[str, Pos] | None = None,
    given: Mapping[str, int] | None = None,
) -> tuple[dict[str, int], dict[str, str]]:
    """Extent of every index variable of ``op_name[indices] = body`` and where it came
    from (see the module docstring), after checking every read stays in bounds.
    ``read_pos``/``var_pos`` give source positions for error messages."""
    read_pos = read_pos or {}
    var_pos = var_pos or {}

    def fail(message: str, pos: Pos | None) -> Exception:
        return _error(ShapeError, message, pos, op_name)

    reduces = [n for n in body.walk() if isinstance(n, Reduce)]
    reduce_axes = [a for r in reduces for a in r.axes]
    extents: dict[str, int | None] = dict.fromkeys([*indices, *reduce_axes])
    sources: dict[str, str] = {}
    for r in reduces:
        for axis, extent in zip(r.axes, r.extents, strict=True):
            if extent is not None:
                if extents[axis] not in (None, extent):
                    raise fail(
                        f"reduction axis '{axis}' is given extents {extents[axis]} and {extent}", var_pos.get(axis)
                    )
                extents[axis], sources[axis] = extent, "given"
    if out_shape is not None:
        for axis, extent in zip(indices, out_shape, strict=True):
            extents[axis], sources[axis] = extent, "output shape"
    for axis, extent in (given or {}).items():
        extents[axis], sources[axis] = extent, "given"
    all_accesses = bounds.accesses(body)
    direct: dict[str, list[tuple[int, str, bool, Read]]] = {}
    for access in all_accesses:
        shape = tensors[access.read.tensor].shape
        for dim, expr in enumerate(access.read.indices):
            if expr.is_Symbol:
                use = (shape[dim], f"{access.read.tensor} dim {dim}", access.conditional, access.read)
                direct.setdefault(expr.name, []).append(use)
    for name in extents:
        uses = direct.get(name, [])
        unconditional = [u for u in uses if not u[2]]
        relevant = unconditional if name in indices else uses
        for size, source, _, read in relevant[1:]:
            if size != relevant[0][0]:
                pos = read_pos.get(read) if read is not None else None
                raise fail(
                    f"shape mismatch for variable '{name}': {relevant[0][1]} gives {relevant[0][0]} "
                    f"but {source} gives {size}",
                    pos or var_pos.get(name),
                )
        if extents[name] is None and relevant:
            extents[name], sources[name] = relevant[0][0], f"indexes {relevant[0][1]}"
        if extents[name] is None and name not in indices:
            raise fail(
                f"cannot infer the range of reduction variable '{name}': it indexes no tensor dimension "
                f"directly; give it as {{{name}: N}}",
                var_pos.get(name),
            )
    shapes = {name: t.shape for name, t in tensors.items()}
    empty: list[str] = []
    if any(e is None for e in extents.values()):
        unbounded = []
        for name, extent in bounds.infer_extents(all_accesses, extents, shapes).items():
            guarded = direct.get(name, [])
            if extent is not None:
                extents[name], sources[name] = extent, "access bounds"
            elif guarded:
                extents[name], sources[name] = guarded[0][0], f"indexes {guarded[0][1]}"
            else:
                unbounded.append(name)
        if unbounded:
            names = ", ".join(f"'{n}'" for n in unbounded)
            raise fail(
                f"cannot infer the range of output variable{'s' if len(unbounded) > 1 else ''} {names}: "
                f"no read bounds {'them' if len(unbounded) > 1 else 'it'}; give the output shape",
                var_pos.get(unbounded[0]),
            )
        empty = [name for name, extent in extents.items() if extent == 0 and sources[name] == "access bounds"]
        for name in empty:  # report the read that fails even at 0, if there is one
            extents[name] = 1
    known = {name: int(e) for name, e in extents.items() if e is not None}
    violation = bounds.first_violation(all_accesses, known, shapes)
    if violation is not None:
        read = violation.access.read
        shown = sorted(set().union(*(index.variables(i) for i in read.indices)))
        where = ", ".join(f"{v}={violation.point[v]}" for v in shown if v in violation.point)
        text = f"{read.tensor}[{', '.join(index.to_text(i) for i in read.indices)}]"
        verb = "write" if read.tensor == op_name else "read"
        raise fail(
            f"{verb} {text} is out of bounds at {where}: index {violation.dim} is {violation.value} but "
            f"'{read.tensor}' has size {shapes[read.tensor][violation.dim]} there",
            read_pos.get(read),
        )
    if empty:
        raise fail(f"output variable '{empty[0]}' has no value that keeps every read in bounds", var_pos.get(empty[0]))
    return known, sources


def make_op(
    name: str,
    indices: Sequence[str],
    body: Expr,
    tensors: Mapping[str, Tensor],
    out_shape: Sequence[int] | None = None,
    out_dtype: str | None = None,
    default_dtype: str = dt.DEFAULT_FLOAT,
    read_pos: Mapping[Read, Pos] | None = None,
    var_pos: Mapping[str, Pos] | None = None,
    scatter: tuple[tuple[sympy.Expr, ...], Sequence[int]] | None = None,
    given: Mapping[str, int] | None = None,
) -> Op:
    """An ``Op`` for ``name[indices] = body``: ranges inferred and every read checked
    (``infer_ranges``); the dtype is ``out_dtype`` or follows from the body.

    With ``scatter = (target, shape)`` the op is ``name[target] += body`` over all
    points of ``indices`` instead, into a tensor of the given shape."""
    if scatter is not None:
        target, shape = scatter
        probe = Read(name, tuple(target), "int64")
        ranges, sources = infer_ranges(
            name,
            indices,
            Binary("+", body, probe),
            {**tensors, name: Tensor(name, tuple(shape))},
            None,
            read_pos,
            var_pos,
        )
        shape = tuple(shape)
    else:
        ranges, sources = infer_ranges(name, indices, body, tensors, out_shape, read_pos, var_pos, given)
        shape = tuple(ranges[v] for v in indices)
    body = map_indices(body, lambda expr: simplify_index(expr, ranges))
    dtype = out_dtype or dt.concrete(default_dtype if body.dtype == dt.WEAK_FLOAT else body.dtype)
    inputs: dict[str, Tensor] = {}
    reads = body if scatter is None else Binary("+", body, Read(name, tuple(scatter[0]), "int64"))
    for access in bounds.accesses(reads):
        if access.read.tensor != name:
            inputs.setdefault(access.read.tensor, tensors[access.read.tensor])
    return Op(
        output=Tensor(name, shape, dtype),
        indices=tuple(indices),
        body=body,
        inputs=tuple(inputs.values()),
        ranges=tuple(ranges.items()),
        range_sources=tuple(sources.items()),
        scatter=None if scatter is None else tuple(scatter[0]),
    )


def _children(node: Node) -> tuple[Node, ...]:
    if isinstance(node, (Subscript, Call)):
        return node.args
    if isinstance(node, BinOp):
        return (node.a, node.b)
    if isinstance(node, UnOp):
        return (node.x,)
    return ()


def build_op(
    stmt: Assign,
    tensors: Mapping[str, Tensor],
    out_shape: Sequence[int] | None = None,
    out_dtype: str | None = None,
    default_dtype: str = dt.DEFAULT_FLOAT,
) -> Op:
    """Turn one parsed statement into an ``Op``.

    ``tensors`` are the tensors it may read; ``out_shape``/``out_dtype`` pin the
    output (else inferred).  Raises ``ParseError``/``ShapeError`` naming the op
    and the position."""
    return _OpBuilder(stmt, tensors, out_shape, out_dtype, default_dtype).build()


def build_ops(
    statements: Sequence[Assign | Declare],
    shapes: Mapping[str, Sequence[int]],
    dtypes: Mapping[str, str],
    default_dtype: str = dt.DEFAULT_FLOAT,
) -> list[Op]:
    """Build every assignment of a program, producers before consumers.

    ``shapes`` and ``dtypes`` give tensors' shapes/dtypes (inputs, and outputs to
    pin); declarations in the text add to them."""
    if not isinstance(shapes, Mapping) or not isinstance(dtypes, Mapping):
        raise ShapeError("shapes and dtypes are mappings from tensor names (shapes={'X': (4, 5)})")
    shapes = {name: given_shape(shape, name) for name, shape in shapes.items()}
    dtypes = {name: dt.check_dtype(d) for name, d in dtypes.items()}
    defining: dict[str, Assign] = {}
    for stmt in statements:
        if isinstance(stmt, Declare):
            if stmt.name in shapes and shapes[stmt.name] != stmt.shape:
                raise _error(
                    ShapeError,
                    f"'{stmt.name}' is declared with shape {list(stmt.shape)} but given "
                    f"shape {list(shapes[stmt.name])}",
                    stmt.pos,
                    stmt.name,
                )
            shapes[stmt.name] = stmt.shape
            if stmt.dtype is not None:
                try:
                    dtypes[stmt.name] = dt.check_dtype(stmt.dtype)
                except ParseError as err:
                    raise _error(ParseError, err.message, stmt.pos, stmt.name) from None
        else:
            if stmt.target.name in defining:
                raise _error(ShapeError, f"tensor '{stmt.target.name}' is defined twice", stmt.pos, stmt.target.name)
            defining[stmt.target.name] = stmt
    built: dict[str, Op] = {}
    tensors: dict[str, Tensor] = {
        name: Tensor(name, shape, dtypes.get(name, default_dtype))
        for name, shape in shapes.items()
        if name not in defining
    }
    active: list[str] = []

    def build(name: str) -> None:
        if name in built:
            return
        if name in active:
            cycle = " -> ".join([*active[active.index(name) :], name])
            raise _error(ShapeError, f"the statements form a cycle: {cycle}", defining[name].pos, name)
        active.append(name)
        stmt = defining[name]
        for read in _reads(stmt.value):
            if read in defining and read != name:
                build(read)
        op = build_op(stmt, tensors, shapes.get(name), dtypes.get(name), default_dtype)
        built[name] = op
        tensors[name] = op.output
        active.pop()

    for name in defining:
        build(name)
    return [built[name] for name in defining]


def _reads(node: Node) -> list[str]:
    names = [node.name] if isinstance(node, Subscript) else []
    for child in _children(node):
        names.extend(_reads(child))
    return names
