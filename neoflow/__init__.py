"""neoflow: a graph-level training compiler.

The public API so far::

    op = neoflow.op("C[i, j] = ReduceAdd({k}, A[i, k] * B[k, j])", shapes={"A": (4, 5), "B": (5, 6)})
    g = neoflow.graph(text_with_several_statements, shapes={...})
    neoflow.evaluate(op_or_graph, {"A": a, "B": b})
"""

from neoflow.autodiff import grad
from neoflow.autodiff.training import TrainSpec
from neoflow.errors import (
    CompileError,
    InputError,
    NeoflowError,
    NonInvertibleMapError,
    NumericError,
    ParseError,
    ResourceError,
    ShapeError,
    UnsupportedOpError,
)
from neoflow.frontend import load_onnx, register_op
from neoflow.ir import Graph, Op, Tensor
from neoflow.ir.text import parse_graph as graph
from neoflow.ir.text import parse_op as op
from neoflow.runtime import CompiledModel, compile, load
from neoflow.runtime.resources import evaluate

__version__ = "0.1.0"

#: bridges imported on first use: ``neoflow.torch`` needs the ``torch`` extra, ``neoflow.jax`` the ``jax`` one
_BRIDGES = ("torch", "jax")


def __getattr__(name: str):
    if name in _BRIDGES:
        import importlib

        return importlib.import_module(f"neoflow.{name}")
    raise AttributeError(f"module 'neoflow' has no attribute '{name}'")


__all__ = [
    "CompileError",
    "CompiledModel",
    "Graph",
    "InputError",
    "NeoflowError",
    "NonInvertibleMapError",
    "NumericError",
    "Op",
    "ParseError",
    "ResourceError",
    "ShapeError",
    "Tensor",
    "TrainSpec",
    "UnsupportedOpError",
    "__version__",
    "compile",
    "evaluate",
    "grad",
    "graph",
    "load",
    "load_onnx",
    "op",
    "register_op",
]
