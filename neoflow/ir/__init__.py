"""The tensor-expression IR: expressions, ops, graphs, text language, interpreter."""

from neoflow.ir.expr import Binary, Cast, Const, Expr, Index, Read, Reduce, Select, Unary
from neoflow.ir.graph import Graph
from neoflow.ir.interpreter import evaluate, evaluate_graph, evaluate_op
from neoflow.ir.op import Op, Tensor
from neoflow.ir.printer import print_graph, print_op
from neoflow.ir.text import parse_graph, parse_op

__all__ = [
    "Binary",
    "Cast",
    "Const",
    "Expr",
    "Graph",
    "Index",
    "Op",
    "Read",
    "Reduce",
    "Select",
    "Tensor",
    "Unary",
    "evaluate",
    "evaluate_graph",
    "evaluate_op",
    "parse_graph",
    "parse_op",
    "print_graph",
    "print_op",
]
