"""One error hierarchy for everything neoflow rejects.

Every error names what it is about (an op, an ONNX node, a tensor) and, for
errors in the text language, the line and column.  ``str(error)`` is a single
line that the CLI prints as it is.
"""

from __future__ import annotations


class NeoflowError(Exception):
    """Base class of all neoflow errors.

    Takes the message and, optionally, the op or node it concerns and a
    position (1-based ``line`` and ``column``) in the source text.
    """

    kind = "error"

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        node: str | None = None,
        line: int | None = None,
        column: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.op = op
        self.node = node
        self.line = line
        self.column = column

    def with_context(self, *, op: str | None = None, node: str | None = None) -> NeoflowError:
        """Return this error with ``op``/``node`` filled in where still missing."""
        if self.op is None and op is not None:
            self.op = op
        if self.node is None and node is not None:
            self.node = node
        return self

    def __str__(self) -> str:
        where: list[str] = []
        if self.node is not None:
            where.append(f"node '{self.node}'")
        if self.op is not None:
            where.append(f"op '{self.op}'")
        if self.line is not None:
            where.append(f"line {self.line}, column {self.column}")
        prefix = f"{self.kind}: " + (", ".join(where) + ": " if where else "")
        return prefix + " ".join(self.message.split())


class ParseError(NeoflowError):
    """Text that is not valid in the tensor-expression language."""

    kind = "parse error"


class ShapeError(NeoflowError):
    """Shapes, ranges or index bounds that do not fit together."""

    kind = "shape error"


class UnsupportedOpError(NeoflowError):
    """An operator, attribute or construct neoflow does not handle."""

    kind = "unsupported"


class NonInvertibleMapError(NeoflowError):
    """An index map autodiff cannot invert into a gather."""

    kind = "autodiff error"


class CompileError(NeoflowError):
    """Code generation or the system compiler failed."""

    kind = "compile error"


class InputError(NeoflowError):
    """Run-time inputs that do not match what a graph or op declares."""

    kind = "input error"


class ResourceError(NeoflowError):
    """A model or op that needs more memory than this machine has, or more work than the time limit allows."""

    kind = "resource error"


class NumericError(NeoflowError):
    """A training step whose loss or updated parameters are not finite (NaN or Inf)."""

    kind = "numeric error"
