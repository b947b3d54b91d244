"""Tensor-expression values and sympy index expressions as C expressions (C and CUDA C++ alike).

Every operation converts its operands to the dtype the reference interpreter
computes in (``Binary.operand_dtype``, ``dtypes.compute_dtype``) and its
result to the node's dtype, so compiled code rounds where the interpreter
does.  Integer floor division and modulo follow Python (``nf_fdiv`` and
``nf_mod``, which each target's prelude defines); floating ``max``/``min`` propagate NaN like numpy.  A ``Select``
between floating values that read nothing (a ReLU mask's 1 or 0) picks one
without a branch (``nf_pickf``): a data-dependent branch is mispredicted about
every other point; one whose values read keeps C's ``?:``, which reads only the
value taken.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import sympy
from sympy.core.function import AppliedUndef

from neoflow.errors import CompileError
from neoflow.ir import dtypes as dt
from neoflow.ir.expr import Binary, Cast, Const, Expr, Index, Read, Reduce, Select, Unary
from neoflow.ir.index import is_power
from neoflow.ir.op import Tensor
from neoflow.ir.simplify import read_offset

C_TYPES = {
    "float16": "_Float16",
    "float32": "float",
    "float64": "double",
    "int8": "int8_t",
    "int16": "int16_t",
    "int32": "int32_t",
    "int64": "int64_t",
    "uint8": "uint8_t",
    "uint16": "uint16_t",
    "uint32": "uint32_t",
    "uint64": "uint64_t",
    "bool": "_Bool",
}


#: The prelude's branch-free choice per floating dtype.
_PICKS = {"float32": "nf_pickf", "float64": "nf_pick"}


def _reads(node: Expr) -> bool:
    """Whether ``node`` reads a tensor or reduces (computing it where a ``Select``
    does not take it might read out of bounds, or cost a whole reduction)."""
    return any(
        isinstance(n, (Read, Reduce)) or (isinstance(n, Index) and n.expr.has(AppliedUndef)) for n in node.walk()
    )


def _mask_product(node: Expr) -> bool:
    """Whether ``node`` is a product of integer selections between 0 and 1 (masks), exact in any float."""

    def mask(n: Expr) -> bool:
        if isinstance(n, Select):
            values = (n.a, n.b)
            return all(isinstance(v, Const) and not isinstance(v.value, float) and v.value in (0, 1) for v in values)
        return isinstance(n, Binary) and n.op == "*" and mask(n.a) and mask(n.b)

    return isinstance(node, Binary) and node.op == "*" and mask(node)


_FLOAT_FUNCS = {"exp": "exp", "log": "log", "sqrt": "sqrt", "tanh": "tanh", "abs": "fabs", "erf": "erf"}


def c_type(dtype: str, types: Mapping[str, str] = C_TYPES) -> str:
    """The C type holding values of ``dtype`` (in the type table ``types``: ``C_TYPES`` for C,
    a CUDA target's for CUDA C++); a dtype the table lacks is refused."""
    name = dt.concrete(dtype)
    if name not in types:
        raise CompileError(f"dtype {name} has no C type on this target")
    return types[name]


def _compute(dtype: str) -> str:
    return str(dt.compute_dtype(dtype))


def _is_float(dtype: str) -> bool:
    return dt.is_float(dt.concrete(dtype))


def _math(name: str, dtype: str) -> str:
    """The C math function for ``name`` in ``dtype`` (``expf`` for float32/16, ``exp`` for float64)."""
    return name if dt.concrete(dtype) == "float64" else f"{name}f"


def _literal(value: object, dtype: str) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return f"INT64_C({value})" if abs(value) >= 2**31 else str(value)
    number = float(value)
    if math.isnan(number):
        return "NAN"
    if math.isinf(number):
        return "INFINITY" if number > 0 else "(-INFINITY)"
    text = repr(number)
    return text if dt.concrete(dtype) == "float64" else f"{text}f"


def cast(text: str, source: str, target: str, types: Mapping[str, str] = C_TYPES) -> str:
    """``text`` (of dtype ``source``) converted to ``target`` (C types from ``types``)."""
    source, target = dt.concrete(source), dt.concrete(target)
    if source == target:
        return text
    if target == "bool":
        return f"(({text}) != 0)"
    return f"(({c_type(target, types)})({text}))"


class IndexPrinter:
    """sympy index expressions as C ``int64_t`` expressions.  ``variable`` maps an
    index variable to its C name; ``read`` renders a data-dependent read.  With
    ``plain_division`` (for expressions whose every term is non-negative: a thread's
    coordinates) floor division and modulo print as C's ``/`` and ``%``."""

    def __init__(
        self,
        variable: Callable[[str], str],
        read: Callable[[str, Sequence[str]], str],
        plain_division: bool = False,
    ) -> None:
        self.variable = variable
        self.read = read
        self.plain_division = plain_division

    def __call__(self, expr: sympy.Expr) -> str:
        if expr.is_Integer:
            return _literal(int(expr), "int64")
        if expr.is_Symbol:
            return self.variable(expr.name)
        if isinstance(expr, AppliedUndef):
            return f"((int64_t){self.read(expr.func.__name__, [self(a) for a in expr.args])})"
        if isinstance(expr, sympy.floor):
            inner = expr.args[0]
            den = sympy.fraction(sympy.together(inner))[1]
            if not den.is_Integer:
                raise CompileError(f"index expression {expr} divides by a non-constant")
            if self.plain_division:
                return f"(({self(sympy.expand(inner * den))}) / {int(den)})"
            return f"nf_fdiv({self(sympy.expand(inner * den))}, {int(den)})"
        if isinstance(expr, sympy.Mod):
            if self.plain_division:
                return f"(({self(expr.args[0])}) % {self(expr.args[1])})"
            return f"nf_mod({self(expr.args[0])}, {self(expr.args[1])})"
        if expr.is_Add:
            return "(" + " + ".join(self(a) for a in expr.args) + ")"
        if expr.is_Mul:
            coeff, rest = expr.as_coeff_Mul()
            if not coeff.is_Integer:
                raise CompileError(f"index expression {expr} has a fractional coefficient")
            factors = [self(f) for f in sympy.Mul.make_args(rest)]
            return (
                "(" + " * ".join([_literal(int(coeff), "int64"), *factors]) + ")"
                if coeff != 1
                else ("(" + " * ".join(factors) + ")")
            )
        if is_power(expr):
            return "(" + " * ".join([self(expr.base)] * int(expr.exp)) + ")"
        raise CompileError(f"index expression {expr} has no C form")


def linear_index(indices: Sequence[str], shape: Sequence[int]) -> str:
    """Row-major offset of ``indices`` (C expressions) in a tensor of ``shape``."""
    if not shape:
        return "0"
    text = indices[0]
    for size, idx in zip(shape[1:], indices[1:], strict=True):
        text = f"({text}) * {size} + {idx}"
    return text


class ValuePrinter:
    """Value expressions as C.  ``tensors`` gives each read tensor's shape and
    C name; ``index`` prints index expressions; ``reduction`` names the C
    variable holding a (separately computed) reduction's value.  Given the
    ``extents`` of the index variables, a read through a reshape's divisions
    whose digits add back up to an affine offset is printed as that offset.
    ``types`` is the C type of each dtype (``C_TYPES``; a CUDA target passes its own).  ``in_lanes``:
    the values are computed in a loop the compiler vectorises, where a choice is a blend of two
    vectors: ``?:`` rather than ``nf_pickf`` (whose bit operations the vectoriser does not take), and
    a product of 0/1 masks (a ReLU6's adjoint) meeting a float computed in that float, not in
    integers converted (which kept GCC 12 from vectorising an epilogue at all)."""

    def __init__(
        self,
        tensors: Mapping[str, Tensor],
        names: Mapping[str, str],
        index: IndexPrinter,
        reduction: Callable[[Reduce], str],
        extents: Mapping[str, int] | None = None,
        types: Mapping[str, str] = C_TYPES,
        in_lanes: bool = False,
    ) -> None:
        self.tensors = tensors
        self.types = types
        self.names = names
        self.index = index
        self.reduction = reduction
        self.extents = extents
        self.in_lanes = in_lanes
        self.on_branch: Callable[[Expr, bool], AbstractContextManager] = lambda cond, positive: nullcontext()

    def read(self, tensor: str, indices: Sequence[str]) -> str:
        """``tensor[indices]`` with C index expressions."""
        return f"{self.names[tensor]}[{linear_index(indices, self.tensors[tensor].shape)}]"

    def _affine_offset(self, read: Read) -> sympy.Expr | None:
        """The flat offset of ``read`` where its indices divide and the box of the
        extents makes the offset affine again, else None."""
        if self.extents is None or not any(i.has(sympy.floor, sympy.Mod) for i in read.indices):
            return None
        offset = read_offset(read.indices, self.tensors[read.tensor].shape, self.extents)
        return None if offset.has(sympy.floor, sympy.Mod) else offset

    def __call__(self, node: Expr, target: str | None = None) -> str:
        """``node`` as C, converted to ``target`` (default: the node's dtype).  A weakly typed float
        (a literal, or an expression of literals alone) is computed in a float ``target``, the dtype
        it meets: ``X * 0.1`` with a double ``X`` multiplies by ``0.1``, not by ``(double)0.1f``."""
        if isinstance(node, Select):  # converting each value alike: the choice stays one of two values
            return self._select(node, node.dtype if target is None else target)
        if self.in_lanes and target is not None and dt.concrete(target) in dt.WIDE_FLOATS and _mask_product(node):
            return f"({self(node.a, target)} * {self(node.b, target)})"
        if target is not None and node.dtype == dt.WEAK_FLOAT and dt.concrete(target) in dt.WIDE_FLOATS:
            return self._value(node, dt.concrete(target))
        text = self._value(node)
        return cast(text, node.dtype, target, self.types) if target is not None else text

    def _value(self, node: Expr, meets: str | None = None) -> str:
        """``node`` as C; ``meets``: the float dtype a weakly typed float ``node`` is computed in."""
        if isinstance(node, Const):
            return _literal(node.value, meets or node.dtype)
        if isinstance(node, Index):
            return self.index(node.expr)
        if isinstance(node, Read):
            offset = self._affine_offset(node)
            if offset is not None:
                return f"{self.names[node.tensor]}[{self.index(offset)}]"
            return self.read(node.tensor, [self.index(i) for i in node.indices])
        if isinstance(node, Reduce):
            return self.reduction(node)
        if isinstance(node, Cast):
            return self(node.x, node.to)
        if isinstance(node, Unary):
            return self._unary(node, meets)
        if isinstance(node, Binary):
            return self._binary(node, meets)
        raise CompileError(f"no C form for {type(node).__name__}")

    def _select(self, node: Select, dtype: str) -> str:
        """``node`` with both values in ``dtype``; floating values that are safe
        to compute whichever way the condition goes are chosen without a branch."""
        cond = self(node.cond, "bool")
        with self.on_branch(node.cond, True):
            a = self(node.a, dtype)
        with self.on_branch(node.cond, False):
            b = self(node.b, dtype)
        pick = _PICKS.get(dt.concrete(dtype))
        if pick is not None and not self.in_lanes and not _reads(node.a) and not _reads(node.b):
            return f"{pick}({cond}, {a}, {b})"
        return f"({cond} ? {a} : {b})"

    def _unary(self, node: Unary, meets: str | None = None) -> str:
        if node.op == "!":
            return f"(!{self(node.x, 'bool')})"
        work = meets or _compute(node.dtype)
        x = self(node.x, work)
        if node.op == "-":
            return f"(-{x})"
        if not _is_float(work):
            if node.op == "abs":
                return f"(({x}) < 0 ? -({x}) : ({x}))"
            raise CompileError(f"'{node.op}' of an integer has no C form")
        if node.op == "sigmoid":
            return f"(1 / (1 + {_math('exp', work)}(-{x})))"
        return f"{_math(_FLOAT_FUNCS[node.op], work)}({x})"

    def _binary(self, node: Binary, meets: str | None = None) -> str:
        if node.op in ("&&", "||"):
            a = self(node.a, "bool")
            with self.on_branch(node.a, node.op == "&&"):
                b = self(node.b, "bool")
            return f"({a} {node.op} {b})"
        weak = meets is not None and node.operand_dtype == dt.WEAK_FLOAT
        operand = meets if weak else _compute(node.operand_dtype)
        a, b = self(node.a, operand), self(node.b, operand)
        floating = _is_float(operand)
        if node.op in ("+", "-", "*", "<", "<=", ">", ">=", "==", "!="):
            text = f"({a} {node.op} {b})"
        elif node.op == "/":
            text = f"({a} / {b})"
        elif node.op == "//":
            text = f"{_math('floor', operand)}({a} / {b})" if floating else f"nf_fdiv({a}, {b})"
        elif node.op == "%":
            text = f"nf_fmod({a}, {b})" if floating else f"nf_mod({a}, {b})"
        elif node.op == "pow":
            text = f"{_math('pow', operand)}({a}, {b})" if floating else f"nf_ipow({a}, {b})"
        elif node.op in ("max", "min"):
            text = f"NF_{'F' if floating else 'I'}{node.op.upper()}({a}, {b})"
        else:
            raise CompileError(f"operator '{node.op}' has no C form")
        result = "bool" if node.dtype == "bool" else operand
        return cast(text, result, meets if weak and node.dtype == dt.WEAK_FLOAT else node.dtype, self.types)


def unflatten_index(flat: str, variables: list[tuple[str, int]]) -> str:
    """C declaring ``v_<name>`` for each variable from a row-major flat index."""
    if not variables:
        return ""
    lines = [f"int64_t rest_ = {flat};"]
    for name, extent in reversed(variables[1:]):
        lines.append(f"const int64_t v_{name} = rest_ % {extent}; rest_ /= {extent};")
    lines.append(f"const int64_t v_{variables[0][0]} = rest_;")
    return " ".join(lines)
