"""One tensor expression, compiled per input shapes, dtype and target on first use: what the framework
bridges (``neoflow.torch``, ``neoflow.jax``) call, whose shapes are known only at call time."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import fields, is_dataclass

from neoflow.errors import InputError, ParseError
from neoflow.ir.op import Op
from neoflow.ir.syntax import Assign, Subscript
from neoflow.ir.text import parse, parse_op
from neoflow.runtime.custom_op import CompiledOp

#: the float dtypes an expression op runs in
FLOATS = ("float32", "float64", "float16", "bfloat16")


class ExpressionOp:
    """``expression`` (one statement): ``output`` its output's name, ``inputs`` the tensors it reads in
    the order the text first reads them (the order callers pass them in); ``fusion`` and ``precision``
    as for ``neoflow.compile``."""

    def __init__(self, expression: str, fusion: str = "neoflow", precision: str | None = None) -> None:
        statements = [s for s in parse(expression) if isinstance(s, Assign)]
        if len(statements) != 1:
            raise ParseError(f"an operator is one statement, found {len(statements)}")
        self.expression = expression
        self.output = statements[0].target.name
        self.inputs = _reads(statements[0].value, self.output)
        if not self.inputs:
            raise ParseError(f"'{self.output}' reads no tensor: an operator needs inputs")
        self.fusion = fusion
        self.precision = precision
        self._compiled: dict[tuple, CompiledOp] = {}
        self._parsed: dict[tuple, Op] = {}
        self._lock = threading.Lock()

    def bind(self, args: Sequence[object], kwargs: Mapping[str, object]) -> list[object]:
        """The call's arrays in ``inputs`` order, from positions and names; an ``InputError`` naming
        what is missing, unknown or given twice."""
        if len(args) > len(self.inputs):
            raise InputError(
                f"{self.output} takes {len(self.inputs)} tensors ({', '.join(self.inputs)}), got {len(args)}"
            )
        bound = dict(zip(self.inputs, args, strict=False))
        for key, value in kwargs.items():
            if key not in self.inputs:
                raise InputError(f"'{key}' is not an input of {self.output} (inputs: {', '.join(self.inputs)})")
            if key in bound:
                raise InputError(f"input '{key}' of {self.output} given twice")
            bound[key] = value
        missing = [n for n in self.inputs if n not in bound]
        if missing:
            raise InputError(f"missing input '{missing[0]}' of {self.output} (inputs: {', '.join(self.inputs)})")
        return [bound[n] for n in self.inputs]

    def float_dtype(self, dtypes: Sequence[str]) -> str:
        """The dtype the op runs in, from its inputs' dtypes (neoflow names): their one float dtype
        (float32 where none is a float)."""
        floats = sorted({d for d in dtypes if d.startswith(("float", "bfloat"))})
        if len(floats) > 1:
            raise InputError(f"{self.output}: inputs mix dtypes {floats}")
        dtype = floats[0] if floats else "float32"
        if dtype not in FLOATS:
            raise InputError(f"{self.output}: dtype {dtype} is not supported ({', '.join(FLOATS)})")
        return dtype

    def parsed(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[str]) -> Op:
        """The op for inputs of these shapes and dtypes (integer and bool inputs keep theirs), kept:
        a framework asks for the output's shape on every call, and parsing takes milliseconds."""
        key = (tuple(map(tuple, shapes)), tuple(dtypes))
        found = self._parsed.get(key)
        if found is None:
            dtype = self.float_dtype(dtypes)
            own = {n: d for n, d in zip(self.inputs, dtypes, strict=True) if not d.startswith(("float", "bfloat"))}
            named = dict(zip(self.inputs, key[0], strict=True))
            found = self._parsed[key] = parse_op(self.expression, named, dtype=dtype, dtypes=own)
        return found

    def compiled(self, shapes: Sequence[Sequence[int]], dtypes: Sequence[str], target: str, grad: bool) -> CompiledOp:
        """The op compiled for ``target`` (with its adjoints: ``grad``), built on first use, then kept."""
        key = (tuple(map(tuple, shapes)), tuple(dtypes), target, grad)
        with self._lock:
            found = self._compiled.get(key)
            if found is None:
                found = self._compiled[key] = CompiledOp(
                    self.parsed(shapes, dtypes), target, grad, self.fusion, self.precision
                )
        return found

    def compiled_keys(self) -> list[tuple]:
        """What has been compiled: (shapes, dtypes, target, grad) per entry."""
        return list(self._compiled)


def _reads(expression: object, output: str) -> list[str]:
    """The tensors an expression's syntax tree reads, in the order of their first read in the text."""
    found: list[tuple[tuple[int, int], str]] = []

    def walk(node: object) -> None:
        if isinstance(node, Subscript):
            found.append((node.pos, node.name))
        if is_dataclass(node):
            for f in fields(node):
                walk(getattr(node, f.name))
        elif isinstance(node, (tuple, list)):
            for item in node:
                walk(item)

    walk(expression)
    names: list[str] = []
    for _, name in sorted(found):
        if name not in names and name != output:
            names.append(name)
    return names
