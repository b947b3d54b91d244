"""Loss functions as tensor-expression ops appended to a forward graph."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from neoflow.errors import InputError, ShapeError
from neoflow.ir import index
from neoflow.ir.op import Op, Tensor
from neoflow.ir.text import build_statement

LOSSES = ("cross_entropy", "mse")


@dataclass(frozen=True)
class Loss:
    """The ops computing a scalar loss from a model output and a label tensor.

    ``labels`` is the new input the training step takes; ``stop`` names tensors
    gradients need not flow through (the max a log-sum-exp subtracts, whose
    derivative cancels exactly)."""

    ops: tuple[Op, ...]
    name: str
    labels: Tensor
    stop: tuple[str, ...] = ()


def cross_entropy(output: Tensor, labels: str, fresh: Callable[[str], str]) -> Loss:
    """Mean softmax cross-entropy of ``output[N, C]`` (logits) against integer
    labels ``labels[N]`` in ``[0, C)``; the same as PyTorch's ``cross_entropy``."""
    if len(output.shape) != 2:
        raise ShapeError(
            f"cross-entropy needs logits of shape [batch, classes]; '{output.name}' has shape {list(output.shape)}"
            " (another loss: mse, or the name of a scalar output)"
        )
    n, _ = output.shape
    y = Tensor(labels, (n,), "int64")
    z = output.name
    peak, total, picked, loss = (fresh(f"loss_{part}") for part in ("max", "sum", "picked", "value"))
    tensors = {z: output, labels: y}
    ops = [build_statement(f"{peak}[n] = ReduceMax({{c}}, {z}[n, c])", tensors)]
    tensors[peak] = ops[-1].output
    ops.append(build_statement(f"{total}[n] = ReduceAdd({{c}}, exp({z}[n, c] - {peak}[n]))", tensors))
    tensors[total] = ops[-1].output
    ops.append(build_statement(f"{picked}[n] = ReduceAdd({{c}}, Select(c == {labels}[n], {z}[n, c], 0))", tensors))
    tensors[picked] = ops[-1].output
    ops.append(
        build_statement(
            f"{loss}[] = ReduceAdd({{n}}, log({total}[n]) + {peak}[n] - {picked}[n]) / {n}", tensors, (), "float32"
        )
    )
    return Loss(tuple(ops), loss, y, stop=(peak,))


def mean_squared_error(output: Tensor, labels: str, fresh: Callable[[str], str]) -> Loss:
    """Mean of ``(output - labels)**2`` over all elements (PyTorch's ``mse_loss``);
    the labels have the output's shape."""
    y = Tensor(labels, output.shape, output.dtype)
    v = ", ".join(index.index_vars(len(output.shape)))
    axes = f"{{{v}}}" if v else "{}"
    diff = f"({output.name}[{v}] - {labels}[{v}])"
    loss = fresh("loss_value")
    body = f"ReduceAdd({axes}, {diff} * {diff}) / {math.prod(output.shape)}" if v else f"{diff} * {diff}"
    op = build_statement(f"{loss}[] = {body}", {output.name: output, labels: y}, (), output.dtype)
    return Loss((op,), loss, y)


def make_loss(kind: str, output: Tensor, labels: str, taken: set[str]) -> Loss:
    """The loss ``kind`` (``"cross_entropy"`` or ``"mse"``) of ``output`` against
    a new input called ``labels``; new tensor names avoid ``taken``."""

    def fresh(base: str) -> str:
        name = index.fresh_name(base, taken)
        taken.add(name)
        return name

    if output.size == 0:
        raise InputError(
            f"the loss would average over no elements: the model output '{output.name}' has shape "
            f"{list(output.shape)} (a batch of at least one sample is needed to train)"
        )
    if kind == "cross_entropy":
        return cross_entropy(output, labels, fresh)
    if kind == "mse":
        return mean_squared_error(output, labels, fresh)
    raise ValueError(f"unknown loss '{kind}' (choose from {', '.join(LOSSES)})")
