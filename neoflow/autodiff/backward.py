"""The graph-level reverse pass: the adjoint of every op on a path from the
parameters to the loss, summed where a tensor feeds several ops.

Each op's adjoints come from ``neoflow.autodiff.adjoint`` (expression
autodiff); this module only wires them together, renames them so that every
tensor of the result is unique, and records which forward tensors the
backward ops read (the activations a training step must keep).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from neoflow.autodiff.adjoint import adjoint
from neoflow.errors import CompileError
from neoflow.ir import index
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op, Tensor, rename_tensors
from neoflow.ir.text import build_statement


@dataclass(frozen=True)
class Backward:
    """The reverse pass of a graph.

    ``ops`` compute the gradients, in an order where each gradient is complete
    as early as possible; ``gradients`` maps each differentiated tensor to the
    name of its gradient tensor; ``saved`` lists the forward tensors the
    backward ops read; ``unreached`` the requested tensors the loss does not
    depend on (they get no gradient); ``adjoints`` maps every tensor the gradients
    flow through (not only the requested ones) to its adjoint tensor."""

    ops: tuple[Op, ...]
    gradients: dict[str, str]
    saved: tuple[str, ...]
    unreached: tuple[str, ...]
    adjoints: dict[str, str]


def _is_float(tensor: Tensor) -> bool:
    return tensor.dtype.startswith("float")


def _active(graph: Graph, loss: str, wrt: Collection[str], stop: Collection[str]) -> set[str]:
    """Tensors that depend on ``wrt`` and that ``loss`` depends on (through ops not in ``stop``)."""
    tensors = graph.tensors
    depends = {name for name in wrt if name in tensors and _is_float(tensors[name])}
    for op in graph.ops:
        if op.name not in stop and _is_float(op.output) and depends.intersection(op.input_names):
            depends.add(op.name)
    reaches = {loss}
    for op in reversed(graph.ops):
        if op.name in reaches and op.name not in stop:
            reaches.update(op.input_names)
    return depends & reaches


def backward(graph: Graph, loss: str, wrt: Sequence[str], stop: Collection[str] = ()) -> Backward:
    """Build the reverse pass of ``graph`` from scalar (or any-shape, seeded with
    ones) tensor ``loss`` to the tensors ``wrt``.

    ``stop`` names tensors treated as constants (no gradient flows through the
    ops defining them).  Raises ``NonInvertibleMapError`` (naming the op) where
    an adjoint cannot be derived."""
    tensors = graph.tensors
    if loss not in tensors:
        raise CompileError(f"the loss '{loss}' is not a tensor of the graph")
    active = _active(graph, loss, wrt, stop)
    taken = set(tensors)

    def fresh(base: str) -> str:
        name = index.fresh_name(base, taken)
        taken.add(name)
        return name

    grad_name = {name: fresh(f"grad_{name}") for name in active}
    consumers = {name: 0 for name in active}
    for op in graph.ops:
        if op.name in active:
            for name in set(op.input_names) & active:
                consumers[name] += 1
    parts: dict[str, list[Op]] = {name: [] for name in active}
    ops: list[Op] = []
    if loss in active:
        ops.append(_statement(grad_name[loss], tensors[loss], "1.0", {}))
    for op in reversed(graph.ops):
        if op.name not in active:
            continue
        if f"d{op.name}" in op.input_names:
            raise CompileError(f"the op reads a tensor named 'd{op.name}', which clashes with its adjoint", op=op.name)
        for name in dict.fromkeys(n for n in op.input_names if n in active):
            part = adjoint(op, name)
            only = consumers[name] == 1
            target = grad_name[name] if only else fresh(f"{grad_name[name]}_part")
            ops.append(rename_tensors(part, {f"d{op.name}": grad_name[op.name], part.name: target}))
            parts[name].append(ops[-1])
            if not only and len(parts[name]) == consumers[name]:
                body = " + ".join(f"{p.name}[{{v}}]" for p in parts[name])
                ops.append(_statement(grad_name[name], tensors[name], body, {p.name: p.output for p in parts[name]}))
    reached = [name for name in wrt if name in active]
    saved = dict.fromkeys(n for op in ops for n in op.input_names if n in tensors)
    return Backward(
        tuple(ops),
        {name: grad_name[name] for name in reached},
        tuple(saved),
        tuple(name for name in wrt if name not in active),
        grad_name,
    )


def _statement(name: str, like: Tensor, body: str, tensors: dict[str, Tensor]) -> Op:
    """``name[i0, ...] = body`` shaped like ``like``, with ``{v}`` in ``body`` standing for the index list."""
    variables = ", ".join(index.index_vars(len(like.shape)))
    return build_statement(f"{name}[{variables}] = {body.format(v=variables)}", tensors, like.shape, like.dtype)
