"""Lowering: an op → statements with isl iteration domains → a C loop nest from isl's AST generator.

An op ``Out[x] = body`` becomes statements over isl sets:

* for each reduction ``R`` in ``body`` (innermost first where they nest), an
  *init* statement ``acc = identity`` over the enclosing points and an
  *update* statement ``acc = acc (+) term`` over the enclosing points times
  ``R``'s own axes, restricted to ``R``'s domain condition and to the guards of
  the ``Select`` branches it sits in (the affine parts in isl, the rest as C
  ``if``) — so a strided or parity domain from autodiff becomes a tight strided
  loop and a read a ``Select`` skips is never performed;
* a *store* statement ``Out[x] = body`` (reductions replaced by their
  accumulators); a ``Select`` at the top of ``body`` whose condition is affine is
  split into two stores on the two parts of the domain (the guard becomes loop
  bounds).

Their schedule keeps every output point's statements together (output
indices outermost, then a statement position, then reduction axes), and isl's
AST generator prints the loops.  Statements are C macros the loops call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import islpy as isl

from neoflow.codegen.c_expr import IndexPrinter, ValuePrinter, c_type, cast, linear_index
from neoflow.codegen.implicit_gemm import guards_to_domain
from neoflow.codegen.inner_split import Written, radix_gather, split_inner
from neoflow.codegen.lattice import Piece, piece_target, split_epilogue, split_lattice, with_reduce
from neoflow.codegen.merged import merged_inner
from neoflow.errors import CompileError
from neoflow.ir import bounds, index
from neoflow.ir.expr import Binary, Expr, Index, Read, Reduce, Select, index_variables
from neoflow.ir.op import Op, Tensor
from neoflow.targets.cpu.chain import chain_function, chain_plan
from neoflow.targets.cpu.flat_depth import FlatDepthPlan, flat_depth_plan
from neoflow.targets.cpu.gemm import (
    ALIAS,
    DEFAULT_BLOCKING,
    Blocking,
    GemmPlan,
    blocked_form,
    gemm_function,
    store_slice,
)
from neoflow.targets.cpu.prelude import PARALLEL_MIN_POINTS
from neoflow.targets.cpu.staging import StagedPlan, staged_plan
from neoflow.targets.cpu.window import WindowPlan, window_function, window_pieces_function, windowed

#: an outermost parallel loop shorter than this is collapsed with the loop it holds
SHORT_PARALLEL_LOOP = 16
#: a sum over fewer terms than this is left to scalar code: split into vector lanes, a sum of
#: two terms went through the stack at every point (the capsule conv's input gradient), while
#: six terms a row (the capsule conv's weight gradient, 1152 terms in rows of 6) ran in half
#: the time of the one scalar accumulator's chain (36 against 19 us)
SHORT_SUM_LOOP = 6
#: an output dimension this short, accumulated in place, is updated innermost (its rows together)
SMALL_OUTPUT_ROWS = 4

PREFIX = bounds.PREFIX
#: the OpenMP reductions a loop of a floating-point sum, max or min runs in vector lanes with (the
#: prelude declares the NaN-propagating max and min: a row max of ViT's attention scores was a scalar
#: compare-and-select chain, 0.51 ms for 0.5 M elements)
_LANE_REDUCTIONS = {
    "float32": {"ReduceAdd": "+", "ReduceMax": "nf_fmaxf", "ReduceMin": "nf_fminf"},
    "float64": {"ReduceAdd": "+", "ReduceMax": "nf_fmax", "ReduceMin": "nf_fmin"},
}
_IDENTITY = {
    "ReduceAdd": "0",
    "ReduceMul": "1",
}
_COMBINE = {"ReduceAdd": "{acc} + {x}", "ReduceMul": "{acc} * {x}"}


@dataclass
class Statement:
    """One statement: a name, its variables, isl domain constraint, schedule and C body."""

    name: str
    variables: list[str]
    constraint: str
    schedule: list[str]
    body: str


@dataclass
class _Scope:
    """Where statements are being created: enclosing variables, the schedule
    prefix, isl constraints and C guards that hold there."""

    variables: list[str]
    prefix: list[str]
    constraints: list[str]
    guards: list[str]
    counter: list[int] = field(default_factory=lambda: [0])

    def position(self) -> str:
        self.counter[0] += 1
        return str(self.counter[0] - 1)

    def guarded(self, cond: Expr, printer: ValuePrinter, positive: bool) -> _Scope:
        """This scope under ``cond`` (or its negation)."""
        affine = bounds.condition_to_isl(cond, positive)
        constraints = [*self.constraints, affine] if affine is not None else self.constraints
        guards = self.guards
        if affine is None or not _fully_affine(cond):
            text = printer(cond, "bool")
            guards = [*guards, text if positive else f"!{text}"]
        return _Scope(self.variables, self.prefix, constraints, guards, self.counter)


def _fully_affine(cond: Expr) -> bool:
    """Whether ``condition_to_isl`` captures ``cond`` exactly (not just a necessary part)."""
    if isinstance(cond, Binary) and cond.op in ("&&", "||"):
        return _fully_affine(cond.a) and _fully_affine(cond.b)
    return bounds.condition_to_isl(cond) is not None


def in_place_reduction(op: Op) -> tuple[Reduce, Expr | None] | None:
    """``(reduction, epilogue)`` when the loop nest of ``op`` accumulates in place
    in its output (one reduction, none nested, the output's last dimension at
    least 4 long: its loop is innermost and vectorised, and no read steps through
    memory along it while a summed axis runs along its own last dimension — a
    BatchNorm statistic ``S[c] = ReduceAdd({n, h, w}, X[n, c, h, w])`` with ``c``
    innermost reads a float a page apart each step: 2.6 GB/s against the 13 of a
    sum along ``w``), else None."""
    split = split_epilogue(op.body, op) if op.scatter is None else None
    if split is None or len(op.indices) == 0 or op.extent[op.indices[-1]] < 4:
        return None
    body = split[0]
    if (
        body.dtype != op.dtype
        or any(isinstance(n, Reduce) for n in body.body.walk())
        or (body.where is not None and any(isinstance(n, Reduce) for n in body.where.walk()))
    ):
        return None
    inner, summed = op.indices[-1], set(body.axes)
    for read in body.body.reads():
        used = [index.variables(i) for i in read.indices]
        if used and summed & used[-1] and any(inner in u for u in used[:-1]):
            return None
    return split


class Lowering:
    """Lower one op to C: ``function(name)`` returns the C definition of a
    function taking the output buffer, then the input buffers in ``op.inputs`` order."""

    def __init__(
        self,
        op: Op,
        buffers: Mapping[str, str] | None = None,
        tag: str = "",
        written: Written | None = None,
        in_place: bool = True,
    ) -> None:
        """``buffers``: the C name of each tensor the op reads and of its output
        (default ``in<k>`` by position and ``out``); ``tag`` prefixes the names
        of its statements and accumulators (ops lowered into one loop nest);
        ``written``: the points of its indices it is computed at and where each
        is stored, when that is not its own output index (an element-wise op);
        ``in_place``: whether a sum may accumulate in its output with its loops
        outside the output's last (``in_place_reduction``), or must sum each output
        point in its own innermost loop (a dot product along a contiguous depth)."""
        if op.scatter is not None and op.reductions:
            raise CompileError("a scatter op with reductions has no C lowering", op=op.name)
        self.op = op
        self.tag = tag
        self.written = written
        self.in_place = in_place
        self.statements: list[Statement] = []
        self.accumulators: list[tuple[str, str]] = []  # (C type, name)
        self.extent = op.extent
        tensors = {t.name: t for t in op.inputs}
        tensors[op.name] = op.output
        # buffers are named by position, so ops that differ only in tensor names lower to the same C
        names = dict(buffers) if buffers is not None else {t.name: f"in{k}" for k, t in enumerate(op.inputs)}
        names.setdefault(op.name, "out")
        self.output = names[op.name]
        self.index = IndexPrinter(lambda v: f"{PREFIX}{v}", lambda t, idx: self.values.read(t, idx))
        self.values = ValuePrinter(tensors, names, self.index, self._reduction, op.extent)
        self.values.on_branch = self._branch
        self._scope: _Scope | None = None
        self._computed: dict[tuple, str] = {}
        # update statement of a floating-point sum, max or min → its accumulator and OpenMP reduction
        self.sums: dict[str, tuple[str, str]] = {}
        # per sum's update statement: its reduction (``_collapsed_sum``)
        self._sum_nodes: dict[str, Reduce] = {}
        self.parallel_depth = len(op.indices)  # the schedule dimensions that are output loops a thread may own

    # --------------------------------------------------------------- statements

    def _add(self, scope: _Scope, variables: list[str], body: str, schedule_tail: list[str] | None = None) -> None:
        constraint = " and ".join(f"({c})" for c in scope.constraints) or "1 = 1"
        if scope.guards:
            body = f"if ({' && '.join(scope.guards)}) {{ {body} }}"
        schedule = [*scope.prefix, scope.position(), *(schedule_tail or [])]
        self.statements.append(Statement(f"S{self.tag}{len(self.statements)}", variables, constraint, schedule, body))

    @contextmanager
    def _branch(self, cond: Expr, positive: bool) -> Iterator[None]:
        """Statements created while printing a ``Select`` branch (or the right side
        of ``&&``/``||``) only run where ``cond`` is ``positive``."""
        scope = self._scope
        assert scope is not None
        self._scope = scope.guarded(cond, self.values, positive)
        try:
            yield
        finally:
            self._scope = scope

    def _reduction(self, node: Reduce) -> str:
        """Create the init and update statements of ``node`` in the current scope
        (once per scope); return its accumulator."""
        scope = self._scope
        assert scope is not None
        key = (node, tuple(scope.variables), tuple(scope.constraints), tuple(scope.guards))
        if key in self._computed:
            return self._computed[key]
        name = f"acc{self.tag}{len(self.accumulators)}"
        self._computed[key] = name
        dtype = node.dtype
        self.accumulators.append((c_type(dtype), name))
        self._add(scope, scope.variables, f"{name} = {self._identity(node)};")
        inner_vars = [*scope.variables, *node.axes]
        box = bounds.box_constraint({a: self.extent[a] for a in node.axes})
        inner = _Scope(
            inner_vars,
            [*scope.prefix, scope.position(), *(PREFIX + a for a in node.axes)],
            [*scope.constraints, box],
            scope.guards,
        )
        self._scope = inner
        if node.where is not None:
            inner = inner.guarded(node.where, self.values, True)
            self._scope = inner
        term = self.values(node.body, dtype)
        combine = self._combine(node, name, term)
        self._add(inner, inner_vars, f"{name} = {combine};")
        if dtype in _LANE_REDUCTIONS and node.kind in _LANE_REDUCTIONS[dtype]:
            self.sums[self.statements[-1].name] = (name, _LANE_REDUCTIONS[dtype][node.kind])
            self._sum_nodes[self.statements[-1].name] = node
        self._scope = scope
        return name

    def _identity(self, node: Reduce) -> str:
        if node.kind in _IDENTITY:
            return cast(_IDENTITY[node.kind], "int64", node.dtype)
        floating = node.dtype.startswith("float")
        if floating:
            return "(-INFINITY)" if node.kind == "ReduceMax" else "INFINITY"
        bits = {"int8": 8, "int16": 16, "int32": 32, "int64": 64, "uint8": 8, "uint16": 16, "uint32": 32, "uint64": 64}
        if node.dtype == "bool":
            return "0" if node.kind == "ReduceMax" else "1"
        width = bits[node.dtype]
        if node.dtype.startswith("u"):
            return "0" if node.kind == "ReduceMax" else f"UINT{width}_MAX"
        return f"INT{width}_MIN" if node.kind == "ReduceMax" else f"INT{width}_MAX"

    def _combine(self, node: Reduce, acc: str, term: str) -> str:
        if node.kind in _COMBINE:
            return cast(_COMBINE[node.kind].format(acc=acc, x=term), node.dtype, node.dtype)
        floating = node.dtype.startswith("float")
        which = "MAX" if node.kind == "ReduceMax" else "MIN"
        # numpy's max/min propagate NaN
        return (
            f"NF_{'F' if floating else 'I'}{which}({acc}, {term})"
            if floating or node.dtype != "bool"
            else (f"({acc} {'||' if which == 'MAX' else '&&'} {term})")
        )

    def _store(self, scope: _Scope, body: Expr) -> None:
        op = self.op
        self._scope = scope
        value = self.values(body, op.dtype)
        out = self.output
        if op.scatter is not None:
            target = linear_index([self.index(e) for e in op.scatter], op.shape)
            self._add(scope, scope.variables, f"{out}[{target}] += {value};")
        else:
            point = [f"{PREFIX}{v}" for v in op.indices]
            where = point if self.written is None else [self.index(e) for e in self.written.target]
            self._add(scope, scope.variables, f"{out}[{linear_index(where, op.shape)}] = {value};")

    def build(self) -> None:
        """Create every statement of the op."""
        op = self.op
        outer = [*op.indices]
        box = bounds.box_constraint({v: self.extent[v] for v in outer})
        constraints = [box] if self.written is None else [box, self.written.where]
        if self.written is None and self.in_place and self._accumulate_in_place(box):
            return
        self._store_split(_Scope(outer, [PREFIX + v for v in outer], constraints, []), op.body)

    def _store_split(self, scope: _Scope, body: Expr) -> None:
        """Store ``body`` over ``scope``; a ``Select`` at its top with an affine
        condition as two stores on the two parts of the domain."""
        if (
            self.op.scatter is None
            and isinstance(body, Select)
            and _fully_affine(body.cond)
            and not any(isinstance(n, Reduce) for n in body.cond.walk())
        ):
            self._store(scope.guarded(body.cond, self.values, True), body.a)
            self._store(scope.guarded(body.cond, self.values, False), body.b)
        else:
            self._store(scope, body)

    def _accumulate_in_place(self, box: str) -> bool:
        """For ``Out[x] = f(Reduce({r | cond}, term))`` (one reduction, none nested),
        accumulate straight into ``Out`` with the reduction loops *outside* the
        innermost output loop: that loop then carries independent updates the C
        compiler vectorises, instead of one accumulator's latency chain.  An
        epilogue ``f`` (a bias, a mask, a crop) is applied by a last pass over the
        point's row.  Returns whether it applied."""
        op = self.op
        split = in_place_reduction(op)
        if split is None:
            return False
        body, epilogue = split
        *outer, inner = op.indices
        # a few output rows (three channels) are updated together, innermost: each read of the
        # other operand then serves all of them
        small = [v for v in outer if 1 < self.extent[v] <= SMALL_OUTPUT_ROWS][-1:]
        kept = [v for v in outer if v not in small]
        shared = bool(small) and any(
            inner in used and small[0] not in used
            for used in (index_variables(node) for node in body.body.walk() if isinstance(node, Read))
        )
        if not shared or not any(self.extent[v] > 1 for v in kept) or self.extent[inner] < 2 * SMALL_OUTPUT_ROWS:
            small, kept = [], outer
        rows = [PREFIX + v for v in small]
        self.parallel_depth = len(kept)
        indices = [f"{PREFIX}{v}" for v in op.indices]
        target = f"{self.output}[{linear_index(indices, op.shape)}]"
        init_scope = _Scope(list(op.indices), [PREFIX + v for v in kept], [box], [])
        self._scope = init_scope
        self._add(init_scope, list(op.indices), f"{target} = {self._identity(body)};", [*rows, PREFIX + inner])
        axes_box = bounds.box_constraint({a: self.extent[a] for a in body.axes})
        update = _Scope([*op.indices, *body.axes], [PREFIX + v for v in kept], [box, axes_box], [], init_scope.counter)
        self._scope = update
        if body.where is not None:
            update = update.guarded(body.where, self.values, True)
            self._scope = update
        term = self.values(body.body, body.dtype)
        combine = self._combine(body, target, term)
        tail = [*(PREFIX + a for a in body.axes), PREFIX + inner, *rows]
        self._add(update, [*op.indices, *body.axes], f"{target} = {combine};", tail)
        if epilogue is not None:
            self._scope = init_scope
            accumulated = Read(op.name, tuple(index.var(v) for v in op.indices), op.dtype)
            value = self.values(with_reduce(epilogue, accumulated), op.dtype)
            self._add(init_scope, list(op.indices), f"{target} = {value};", [*rows, PREFIX + inner])
        return True

    # ---------------------------------------------------------------------- C

    def loops(self) -> str:
        """The loop nest isl generates for the statements (C text calling them)."""
        return isl_loops(self.statements)

    def function(self, name: str, work: int | None = None) -> str:
        """The C function computing the op (the output first, then the inputs).
        ``work``: the points that decide whether threads share the outer loop
        (``PARALLEL_MIN_POINTS``); default the op's own box, a piece of a larger
        op passes that op's, so that splitting a domain does not make it serial."""
        self.build()
        op = self.op
        params = [f"{c_type(op.dtype)} *restrict out"]
        params += [f"const {c_type(t.dtype)} *restrict in{k}" for k, t in enumerate(op.inputs)]
        lines = [f"void {name}({', '.join(params)}) {{"]
        macros = statement_macros(self.statements)
        for ctype, acc in self.accumulators:
            lines.append(f"    {ctype} {acc};")
        if op.scatter is not None:
            lines.append(f"    memset(out, 0, sizeof(*out) * {op.output.size});")
        loops = self.loops()
        work = math.prod(self.extent.values()) if work is None else work
        parallel = op.scatter is None and any(self.extent[v] > 1 for v in op.indices) and work >= PARALLEL_MIN_POINTS
        private = f" private({', '.join(a for _, a in self.accumulators)})" if self.accumulators else ""
        outer_dims = {f"c{k}" for k in range(self.parallel_depth)}
        # a scalar sum: its threads each sum a share of the outermost loop
        added = [acc for acc, reduction in self.sums.values() if reduction == "+"]
        total = added[0] if not op.indices and len(self.accumulators) == 1 and added else None

        collapsed: set[int] = set()  # rows of inner loops a collapsed simd loop above already covers

        def pragmas(rows: Sequence[str], number: int, outermost: bool) -> list[str]:
            text, following = loop_pair(rows, number)
            found = []
            if number in collapsed:
                return found
            # an outermost loop over an output dimension (isl may put sibling loops in a block)
            if parallel and outermost and loop_variable(text) in outer_dims:
                # a short outer loop leaves threads idle: share out the loop nested in it too, when that
                # loop is all it holds (isl braces several statements)
                nested = loop_variable(following) in outer_dims
                collapse = " collapse(2)" if nested and collapsible(text, following) else ""
                found.append(f"parallel for{collapse}{private}")
            elif total is not None and outermost and work >= PARALLEL_MIN_POINTS:
                found.append(f"parallel for reduction(+:{total})")
            summed = self._summed_by(following)
            if summed is not None and most_trips(text) >= SHORT_SUM_LOOP:
                # the loop around one sum's (max's, min's) update: let the compiler split it into vector lanes
                found.append(f"simd reduction({summed[1]}:{summed[0]})")
            elif not outermost and number + 2 < len(rows) and self._collapsed_sum(text, following, rows[number + 2]):
                summed = self._summed_by(rows[number + 2])
                assert summed is not None
                found.append(f"simd reduction({summed[1]}:{summed[0]}) collapse(2)")
                collapsed.add(number + 1)
            return found

        lines += with_pragmas(self._flattened(loops), pragmas)
        lines.append("}")
        undefs = [f"#undef {s.name}" for s in self.statements]
        return "\n".join([*macros, *lines, *undefs])

    def _collapsed_sum(self, outer: str, inner: str, update: str) -> bool:
        """Whether the loop ``outer``, holding only the loop ``inner`` around one sum's ``update``,
        should be split into vector lanes together with it (``simd collapse(2)``): both loops run
        over summed axes, with constant bounds, and every read that moves with them reads the
        tensor's last two dimensions at exactly those axes, the inner one the whole last dimension,
        so the two loops walk one contiguous run.  A BatchNorm statistic ``S[c] = ReduceAdd({n, h,
        w}, X[n, c, h, w])`` sums a 32-long row at a time otherwise, reducing its vector lanes at
        every row: 0.43 ms against 0.062 ms collapsed (2 x 64 x 32 x 32 floats, 2 threads, gcc)."""
        text = update.strip()
        name = text.split("(", 1)[0]
        if name not in self._sum_nodes or outer.endswith("{") or inner.endswith("{"):
            return False
        if not inner.startswith("for (int ") or math.inf in (trip_count(outer), trip_count(inner)):
            return False
        node = self._sum_nodes[name]
        variables, arguments = self._call(text)
        try:
            high = variables[arguments.index(loop_variable(outer))]
            low = variables[arguments.index(loop_variable(inner))]
        except ValueError:
            return False
        if high not in node.axes or low not in node.axes or trip_count(inner) != self.extent[low]:
            return False
        tensors = {t.name: t for t in self.op.inputs}
        for read in node.body.reads():
            used = [index.variables(i) for i in read.indices]
            if not any({high, low} & u for u in used):
                continue
            shape = tensors[read.tensor].shape if read.tensor in tensors else None
            if (
                shape is None
                or len(used) < 2
                or any({high, low} & u for u in used[:-2])
                or read.indices[-1] != index.var(low)
                or read.indices[-2] != index.var(high)
                or shape[-1] != self.extent[low]
            ):
                return False
        return True

    def _flattened(self, loops: str) -> str:
        """``loops`` with each pair of loops that walk one contiguous run of a sum's reads
        (``_collapsed_sum``) made one loop over the run, where both start at 0 and the sum uses
        their variables nowhere else: the update is called with the outer variable 0 and the
        inner one counting over the whole run.  ``simd collapse(2)`` over the pair divides the
        one counter back into two, and the compiler then gathered the reads of a global average
        pool under a ReLU6 (0.46 ms, against 0.13 ms as one loop, 2 x 128 x 64 floats)."""
        rows = loops.splitlines()
        found: list[str] = []
        open_loops: list[int] = []  # indentation of the enclosing for loops, as ``with_pragmas`` keeps it
        number = 0
        while number < len(rows):
            row = rows[number]
            outer = row.lstrip()
            indent = len(row) - len(outer)
            while open_loops and indent <= open_loops[-1]:
                open_loops.pop()
            # an outermost loop is the one threads share: it stays
            if open_loops and number + 2 < len(rows) and outer.startswith("for (int "):
                flat = self._flat_run(outer, rows[number + 1].lstrip(), rows[number + 2])
                if flat is not None:
                    loop, update = flat
                    found += [row[:indent] + loop, update]
                    number += 3
                    continue
            if outer.startswith("for (int "):
                open_loops.append(indent)
            found.append(row)
            number += 1
        return "\n".join(found)

    def _flat_run(self, outer: str, inner: str, update: str) -> tuple[str, str] | None:
        """The loop over the run and the update row calling it (``_flattened``), or None."""
        if not inner.startswith("for (int ") or not self._collapsed_sum(outer, inner, update):
            return None
        if _loop_ends(outer)[0] != "0" or _loop_ends(inner)[0] != "0":
            return None
        text = update.strip()
        name = text.split("(", 1)[0]
        variables, arguments = self._call(text)
        high_at, low_at = arguments.index(loop_variable(outer)), arguments.index(loop_variable(inner))
        moving = {variables[high_at], variables[low_at]}
        node = self._sum_nodes[name]
        values = [n for n in node.walk() if isinstance(n, Index)]
        if any(moving & index.variables(n.expr) for n in values):
            return None
        counter = loop_variable(inner)
        arguments[high_at] = "0"
        run = int(trip_count(outer) * trip_count(inner))
        loop = f"for (int {counter} = 0; {counter} <= {run - 1}; {counter} += 1)"
        return loop, update[: len(update) - len(update.lstrip())] + f"{name}({', '.join(arguments)});"

    def _call(self, text: str) -> tuple[list[str], list[str]]:
        """The variables of the statement a loop body's call ``S(a, b, ...);`` names, and its arguments."""
        name = text.split("(", 1)[0]
        variables = next(s.variables for s in self.statements if s.name == name)
        return variables, [a.strip() for a in text[len(name) + 1 : text.rindex(")")].split(",")]

    def _summed_by(self, line: str) -> tuple[str, str] | None:
        """The accumulator and OpenMP reduction of the sum (max, min) whose update ``line`` (the body of a
        loop) is, if it is one."""
        text = line.strip()
        name = text.split("(", 1)[0]
        return self.sums.get(name) if text.endswith(");") and text.count(";") == 1 else None


def isl_loops(statements: Sequence[Statement], separate: bool = False) -> str:
    """The loop nest isl's AST generator prints for ``statements`` (each over
    its domain, in its schedule's order), as C text calling them; ``separate``
    splits loops where the set of statements they run changes (no guards left
    inside a loop)."""
    depth = max(len(s.schedule) for s in statements)
    domains, schedules = [], []
    for s in statements:
        variables = ", ".join(PREFIX + v for v in s.variables)
        domains.append(f"{s.name}[{variables}] : {s.constraint}")
        times = [*s.schedule, *["0"] * (depth - len(s.schedule))]
        schedules.append(f"{s.name}[{variables}] -> [{', '.join(times)}]")
    domain = isl.UnionSet("{ " + "; ".join(domains) + " }")
    schedule = isl.UnionMap("{ " + "; ".join(schedules) + " }").intersect_domain(domain)
    build = isl.AstBuild.from_context(isl.Set("{ : }"))
    if separate:
        times = ", ".join(f"t{k}" for k in range(depth))
        build = build.set_options(isl.UnionMap(f"{{ [{times}] -> separate[x] }}"))
    return build.node_from_schedule_map(schedule).to_C_str()


def statement_macros(statements: Sequence[Statement]) -> list[str]:
    """The ``#define`` of each statement: its variables bound from the macro's arguments, then its body."""
    macros = []
    for s in statements:
        args = ", ".join(f"a{k}" for k in range(len(s.variables)))
        binds = "".join(f"const int64_t {PREFIX}{v} = (a{k}); " for k, v in enumerate(s.variables))
        macros.append(f"#define {s.name}({args}) do {{ {binds}{s.body} }} while (0)")
    return macros


def loop_pair(rows: Sequence[str], number: int) -> tuple[str, str]:
    """The ``for`` line ``number`` of ``rows`` and the line after it, unindented."""
    following = rows[number + 1].lstrip() if number + 1 < len(rows) else ""
    return rows[number].lstrip(), following


def loop_variable(loop: str) -> str:
    """The iterator of an isl ``for (int c = ...`` line (the text after ``for (int `` up to a space)."""
    return loop[len("for (int ") :].split(" ", 1)[0]


def collapsible(loop: str, following: str) -> bool:
    """Whether the short outer ``loop`` should be collapsed with ``following``: the loop is
    all it holds (no block), and its bounds are constants (OpenMP's rule: they may not
    depend on the outer loop); a short outer loop alone would leave threads idle."""
    return (
        not loop.endswith("{")
        and following.startswith("for (int ")
        and trip_count(loop) < SHORT_PARALLEL_LOOP
        and trip_count(following) < math.inf
    )


def with_pragmas(loops: str, pragmas: Callable[[Sequence[str], int, bool], Sequence[str]]) -> list[str]:
    """isl's ``loops`` as the lines of a function body, with ``#pragma omp <p>`` above
    the ``for`` on line ``k`` for each ``p`` of ``pragmas(rows, k, outermost)``."""
    rows = loops.splitlines()
    lines: list[str] = []
    open_loops: list[int] = []  # indentation of the enclosing for loops
    for number, line in enumerate(rows):
        text = line.lstrip()
        indent = len(line) - len(text)
        while open_loops and indent <= open_loops[-1]:
            open_loops.pop()
        if text.startswith("for (int "):
            lines += [f"    {' ' * indent}#pragma omp {p}" for p in pragmas(rows, number, not open_loops)]
            open_loops.append(indent)
        lines.append("    " + line)
    return lines


def trip_count(loop: str) -> float:
    """The iteration count of an isl ``for (int c = A; c <= B; c += 1)`` line with constant
    bounds, infinity when they are not constants."""
    try:
        start, stop, strict = _loop_ends(loop)
        return int(stop) - strict - int(start) + 1
    except ValueError:
        return math.inf


def most_trips(loop: str) -> float:
    """An upper bound on the iterations of an isl ``for (int c = A; c <= B; c += 1)`` line:
    ``A`` a constant or ``max(...)`` of terms (at least its largest constant), ``B`` a constant
    or ``min(...)`` (at most its smallest); infinity where an end gives no constant."""
    try:
        start, stop, strict = _loop_ends(loop)
        high = _constant_bound(stop, "min", min) - strict
        return max(high - _constant_bound(start, "max", max) + 1, 0)
    except ValueError:
        return math.inf


def _loop_ends(loop: str) -> tuple[str, str, int]:
    """The start and end expressions of an isl ``for`` line, and 1 where the end is
    strict (``<``); ``ValueError`` for a line of another form."""
    header = loop[loop.index("(") + 1 : loop.rindex(")")]
    start, stop, _ = (part.strip() for part in _top_level(header, ";"))
    strict = "<=" not in stop
    return start.split("=", 1)[1].strip(), stop.split("<" if strict else "<=", 1)[1].strip(), int(strict)


def _top_level(text: str, separator: str) -> list[str]:
    """``text`` split at each ``separator`` outside parentheses."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += (char == "(") - (char == ")")
        if char == separator and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current]


def _constant_bound(text: str, function: str, pick: Callable[[list[int]], int]) -> int:
    """The constant ``text`` is, or ``pick`` of the constant arguments of a ``function(...)``
    call (``ValueError`` when there are none)."""
    text = text.strip()
    if text.startswith(f"{function}(") and text.endswith(")"):
        constants = [
            int(arg) for arg in _top_level(text[len(function) + 1 : -1], ",") if arg.strip().lstrip("-").isdigit()
        ]
        if not constants:
            raise ValueError(text)
        return pick(constants)
    return int(text)


def lower_pieces(op: Op, pieces: Sequence[Piece], name: str) -> str:
    """The C function ``name`` computing ``op`` piece by piece (``lattice.split_lattice``):
    each dense piece is a plain loop nest (``name_p<k>``) into a contiguous buffer,
    scattered to its strided slice of the output; an element-wise piece (an epilogue
    where the sum is empty) stores each point where it goes instead (``piece_target``:
    the four-op ``neoflow`` step's parameter update, in-step 652.7 -> 603.5 and
    660.1 -> 511.5 us in two noisy runs), as does a piece of depthwise window form (``window``:
    a strided depthwise convolution's input adjoint); empty pieces zero theirs.  Each
    loop is shared among threads where the whole op's would be: the pieces of a
    capsule conv's input gradient are a quarter of it each, serial they made the
    capsule network's training step 6-7 % slower (0.170 against 0.159 ms, 2 threads)."""
    ctype = c_type(op.dtype)
    arguments = "".join(f", in{k}" for k in range(len(op.inputs)))
    work = math.prod(op.extent.values())
    helpers, lines = [], []
    windows = _window_pieces(pieces)
    if windows is not None:  # every dense piece a window over the same planes: one loop over them all
        function = f"{name}_windows"
        helpers.append(file_local(window_pieces_function(op, windows, function), function))
        lines.append(f"    {function}(out{arguments});")
        pieces = [piece for piece in pieces if piece.empty]
    for number, piece in enumerate(pieces):
        if piece.empty:
            lines.append(store_slice(piece, "0", op.output.size))
            continue
        function = f"{name}_p{number}"
        target = None if piece.op.reductions else piece_target(piece, op.shape)
        window = windowed(piece.op) if target is None else None
        if target is not None:  # an element-wise piece stores each point where it goes
            written = Written(target, (), bounds.box_constraint(piece.op.extent))
            code = Lowering(replace(piece.op, output=op.output), written=written).function(function, work)
            call = f"    {function}(out{arguments});"
        elif window is not None:  # a strided depthwise convolution's input adjoint: each piece a window
            code = window_function(piece.op, window, function, (piece.base, piece.strides))
            call = f"    {function}(out{arguments});"
        else:
            code = Lowering(piece.op).function(function, work)
            call = f"""    {{
        NF_SCRATCH({ctype}, part, {piece.op.output.size});
        {function}(part{arguments});
{store_slice(piece, "part[f]", op.output.size)}
    }}"""
        helpers.append(file_local(code, function))
        lines.append(call)
    body = "\n".join(lines)
    return "\n".join(helpers) + f"\nvoid {name}({_parameters(op)}) {{\n{body}\n}}\n"


def _window_pieces(pieces: Sequence[Piece]) -> list[tuple[WindowPlan, tuple[int, dict[str, int]]]] | None:
    """Each dense piece's convolution plan and placement where every dense piece is a window over
    the same outer points (``window_pieces_function``), else None."""
    found = []
    for piece in pieces:
        if piece.empty:
            continue
        plan = windowed(piece.op) if piece.op.reductions else None
        if not isinstance(plan, WindowPlan) or (found and plan.outer != found[0][0].outer):
            return None
        found.append((plan, (piece.base, piece.strides)))
    return found or None


def _parameters(op: Op) -> str:
    """The C parameter list of a kernel computing ``op``: ``out``, then ``in<k>`` per input."""
    inputs = (f"const {c_type(t.dtype)} *restrict in{k}" for k, t in enumerate(op.inputs))
    return ", ".join([f"{c_type(op.dtype)} *restrict out", *inputs])


def file_local(source: str, function: str, attributes: str = "") -> str:
    """``source`` with its definition of ``function`` made file-local (a helper of
    another kernel), with the C ``attributes`` given (``__attribute__((noinline))``)."""
    prefix = f"{attributes} static" if attributes else "static"
    return source.replace(f"void {function}(", f"{prefix} void {function}(", 1)


def staged_function(op: Op, plan: StagedPlan, name: str) -> str:
    """The C function ``name`` computing ``op`` in the two stages of ``plan``:
    the partial sums into a buffer of their own, then the output from them (a slice
    of ``plan.batch`` rows at a time where it has one, pointers moved to each slice)."""
    arguments = {t.name: f"in{k}" for k, t in enumerate(op.inputs)}
    arguments[plan.stage.name] = "sums"
    helpers = [
        file_local(lower_op(stage, f"{name}_{suffix}"), f"{name}_{suffix}")
        for suffix, stage in (("s", plan.stage), ("r", plan.rest))
    ]
    full = {t.name: t for t in op.inputs}

    def at_slice(tensor: Tensor, pointer: str) -> str:
        """``pointer`` moved to the slice's first row where the stage reads a slice of the tensor."""
        whole = full.get(tensor.name)
        if plan.batch is None or whole is None or whole.shape == tensor.shape:
            return pointer
        return f"{pointer} + b0 * {whole.size // whole.shape[0]}"

    stage_args = ", ".join(at_slice(t, arguments[t.name]) for t in plan.stage.inputs)
    rest_args = ", ".join(at_slice(t, arguments[t.name]) for t in plan.rest.inputs)
    if plan.batch is None:
        body = f"""    NF_SCRATCH(float, sums, {plan.stage.output.size});
    {name}_s(sums, {stage_args});
    {name}_r(out, {rest_args});"""
    else:
        rows, row_size = op.shape[0], op.output.size // op.shape[0]
        body = f"""    NF_SCRATCH(float, sums, {plan.stage.output.size});
    for (int64_t b0 = 0; b0 < {rows}; b0 += {plan.batch}) {{  /* a slice of the leading variable at a time */
        {name}_s(sums, {stage_args});
        {name}_r(out + b0 * {row_size}, {rest_args});
    }}"""
    return "\n".join(helpers) + f"\nvoid {name}({_parameters(op)}) {{\n{body}\n}}\n"


def blocked_function(op: Op, run: Op, plan: GemmPlan, name: str, blocking: Blocking) -> str:
    """The C function ``name`` computing ``op`` on the blocked kernel as ``run`` (``gemm.blocked_form``):
    that kernel itself, or where ``run`` reads a tensor of ``op`` under an alias too
    (``gemm.alias_shared_operand``), that kernel as a helper given the tensor for both."""
    extra = [t.name for t in run.inputs[len(op.inputs) :]]
    if not extra:
        return gemm_function(run, plan, name, blocking)
    position = {t.name: k for k, t in enumerate(op.inputs)}
    arguments = [f"in{k}" for k in range(len(op.inputs))] + [f"in{position[n.removesuffix(ALIAS)]}" for n in extra]
    helper = file_local(gemm_function(run, plan, f"{name}_b", blocking), f"{name}_b")
    return f"{helper}\nvoid {name}({_parameters(op)}) {{\n    {name}_b(out, {', '.join(arguments)});\n}}\n"


def flat_function(op: Op, plan: FlatDepthPlan, name: str) -> str:
    """The C function ``name`` computing ``op`` from its operands copied flat along the
    depth (``flat_depth``): each copy into a scratch buffer of its own (``name_a``,
    ``name_b``), then one dot product a point (``name_p``)."""
    arguments = {t.name: f"in{k}" for k, t in enumerate(op.inputs)}
    helpers, lines = [], []
    for side, pack in zip("ab", plan.packs, strict=True):
        helpers.append(file_local(lower_op(pack, f"{name}_{side}"), f"{name}_{side}"))
        inputs = ", ".join(arguments[t.name] for t in pack.inputs)
        arguments[pack.name] = f"pack_{side}"
        lines.append(f"    NF_SCRATCH({c_type(pack.dtype)}, pack_{side}, {pack.output.size});")
        lines.append(f"    {name}_{side}(pack_{side}, {inputs});")
    product = Lowering(plan.product, in_place=False).function(f"{name}_p")
    helpers.append(file_local(product, f"{name}_p"))
    lines.append(f"    {name}_p(out, {', '.join(arguments[t.name] for t in plan.product.inputs)});")
    body = "\n".join(lines)
    return "\n".join(helpers) + f"\nvoid {name}({_parameters(op)}) {{\n{body}\n}}\n"


#: the ways ``lower_op`` can compute an op, in the order it tries them
PATHS = ("chain", "flat", "staged", "window", "blocked", "pieces", "nest")


@dataclass(frozen=True)
class KernelChoice:
    """How to lower one op: ``path`` (one of ``PATHS``, or ``auto``: the first that applies) and, on
    the blocked path, its ``blocking``.  The tuner (``targets.cpu.tuning``) measures the choices."""

    path: str = "auto"
    blocking: Blocking = DEFAULT_BLOCKING


def lowering_paths(op: Op) -> list[str]:
    """The paths of ``PATHS`` that can compute ``op`` (the plain loop nest always can)."""
    found = []
    if op.scatter is None:
        plans = (
            ("chain", chain_plan),
            ("flat", flat_depth_plan),
            ("staged", staged_plan),
            ("window", windowed),
            ("blocked", blocked_form),
            ("pieces", _lattice_pieces),
        )
        found = [path for path, plan in plans if plan(op) is not None]
    return [*found, "nest"]


def _lattice_pieces(op: Op) -> list[Piece] | None:
    """The dense pieces of a lattice domain of more than one piece (or an empty one), else None."""
    pieces = split_lattice(op) if op.scatter is None else None
    return pieces if pieces and (len(pieces) > 1 or pieces[0].empty) else None  # none: an empty op


def lower_op(op: Op, name: str, choice: KernelChoice | None = None) -> str:
    """The C function ``name`` computing ``op``: a chain of two contractions tiled
    together (``chain``), a contraction over a depth of short runs from its operands
    copied flat (``flat_depth``), a contraction in two stages (``staging``), a depthwise
    convolution (its input adjoint, its weight gradient) over zero-bordered planes (``window``), the blocked
    kernel for contractions worth it, dense pieces for other lattice domains, an
    element-wise op of the depth-to-space family over its split inner index
    (``inner_split``), else the plain loop nest (over merged trailing dimensions
    where the op is point-wise and its innermost extent short: ``merged``).  A
    ``choice`` takes its path where it applies (and on the blocked path its blocking)."""
    choice = choice or KernelChoice()
    wanted = choice.path if choice.path != "auto" and choice.path in lowering_paths(op) else "auto"

    def tried(path: str) -> bool:
        return wanted in ("auto", path)

    try:
        chain = chain_plan(op) if tried("chain") else None
        if chain is not None:
            return chain_function(op, chain, name)
        flat = flat_depth_plan(op) if tried("flat") else None
        if flat is not None:
            return flat_function(op, flat, name)
        staged = staged_plan(op) if tried("staged") else None
        if staged is not None:
            return staged_function(op, staged, name)
        window = windowed(op) if tried("window") else None
        if window is not None:
            return window_function(op, window, name)
        blocked = blocked_form(op) if tried("blocked") else None
        if blocked is not None:
            return blocked_function(op, blocked[0], blocked[1], name, choice.blocking)
        pieces = _lattice_pieces(op) if tried("pieces") else None
        if pieces is not None:
            return lower_pieces(op, pieces, name)
        op = radix_gather(op) or op  # a sum of one term at every point: its reads, affine
        split = split_inner(op, None) if op.scatter is None and not op.reductions else None
        if split is not None:  # the depth-to-space family: unit-stride inner loops
            return Lowering(split[0], written=split[1]).function(name)
        if op.scatter is None:  # a padding guard becomes loop bounds
            op = guards_to_domain(op, lattice_only=False)
        return Lowering(merged_inner(op) or op).function(name)
    except CompileError as err:
        raise err.with_context(op=op.name) from None
