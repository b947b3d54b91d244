"""Which converter handles which ONNX op type (and custom ops by type)."""

from __future__ import annotations

from collections.abc import Callable

from neoflow.frontend.context import NodeContext

Converter = Callable[[NodeContext], None]
CONVERTERS: dict[str, Converter] = {}
CUSTOM_EXPRESSIONS: dict[str, str] = {}


def converter(*op_types: str) -> Callable[[Converter], Converter]:
    """Register the decorated function as the converter of ``op_types``."""

    def register(fn: Converter) -> Converter:
        for op_type in op_types:
            CONVERTERS[op_type] = fn
        return fn

    return register


def register_op(name: str, text: str) -> None:
    """Register a custom op type by its text-language definition.

    ``text`` is one statement whose output is written ``Out`` and whose inputs
    are ``In0, In1, ...`` in the node's input order, e.g.
    ``Out[i, j] = ReduceAdd({k}, In0[i, k] * In1[k, j])``.  Nodes of type
    ``name`` (any domain) are then imported as that op."""
    CUSTOM_EXPRESSIONS[name] = text
