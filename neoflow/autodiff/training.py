"""From a forward graph to one training graph: forward → loss → reverse pass → optimizer update.

The result is a plain ``Graph`` of TE ops plus what a runtime needs to drive
it: which inputs are data, labels, learning rate and noise; which tensors are
trainable parameters and optimizer state; and which tensor holds the next
value of each of them.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np

from neoflow.autodiff.backward import backward
from neoflow.autodiff.losses import LOSSES, make_loss
from neoflow.autodiff.optimizers import OptimizerSettings, optimizer_ops
from neoflow.errors import InputError, ShapeError
from neoflow.ir import index
from neoflow.ir.graph import Graph
from neoflow.ir.op import Op, Tensor


@dataclass(frozen=True)
class TrainSpec:
    """How to train a model.

    ``loss``: ``"cross_entropy"`` (softmax cross-entropy of the model output
    against integer labels), ``"mse"``, or the name of a scalar output the
    model already computes.  ``labels``: the name of the label input the
    training step takes (unused when the model computes its loss).
    ``output``: which model output the loss reads (default: the only one).
    ``optimizer``: ``sgd``, ``momentum``, ``nesterov``, ``adam`` or ``adamw``
    with ``lr``, ``momentum``, ``weight_decay``, ``betas``, ``eps``.
    ``frozen``: parameter names (as in the model file) not to train.
    ``seed``: seeds the dropout noise.  ``keep_prediction``: each training step
    also hands back the model output (``CompiledModel.last_prediction``, what a
    training accuracy is counted from); off, a step writes only the loss and the
    updated parameters and state, and a fusion plan need not store the output."""

    loss: str = "cross_entropy"
    labels: str = "labels"
    optimizer: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    frozen: tuple[str, ...] = ()
    output: str | None = None
    seed: int = 0
    keep_prediction: bool = False

    def __post_init__(self) -> None:
        checked_learning_rate(self.lr)

    @property
    def optimizer_settings(self) -> OptimizerSettings:
        """The optimizer part of the spec (checked)."""
        return OptimizerSettings(
            self.optimizer, self.momentum, self.nesterov, self.weight_decay, tuple(self.betas), self.eps
        ).normalised()


def checked_learning_rate(value: object) -> float:
    """``value`` as a learning rate: a finite number >= 0, or an ``InputError``."""
    try:
        lr = float(value)
    except (TypeError, ValueError):
        raise InputError(f"the learning rate must be a number, got {value!r:.40}") from None
    if not math.isfinite(lr) or lr < 0:
        raise InputError(f"the learning rate must be a finite number >= 0, got {lr}")
    return lr


@dataclass(frozen=True)
class TrainingGraph:
    """A training step as one graph.

    ``graph`` computes ``loss``, the model output ``prediction`` and the next
    value of every tensor in ``updates`` (parameter or state name → tensor).
    Its inputs are the model's data inputs, ``labels`` (when the spec's loss
    needs them), the scalar ``learning_rate``, the ``noise`` inputs, and the
    parameters and ``state`` (whose initial values it holds).  ``gradients``
    maps each trainable parameter to its gradient tensor; ``saved`` are the
    forward tensors the reverse pass reads; ``batch_statistics`` maps each mean over the batch a
    layer normalises with (``Graph.batch_statistics``) to its adjoint (None where no gradient flows
    through it): the tensors data-parallel training averages across ranks to synchronise BatchNorm."""

    graph: Graph
    loss: str
    prediction: str
    labels: Tensor | None
    learning_rate: str
    trainable: tuple[str, ...]
    frozen: tuple[str, ...]
    gradients: Mapping[str, str]
    state: Mapping[str, np.ndarray]
    updates: Mapping[str, str]
    noise: tuple[str, ...]
    saved: tuple[str, ...]
    data_inputs: tuple[Tensor, ...] = field(default=())
    stages: Mapping[str, int] = field(default_factory=dict)  # ops per stage: forward, loss, backward, optimizer
    batch_statistics: Mapping[str, str | None] = field(default_factory=dict)


def internal_names(graph: Graph) -> dict[str, str]:
    """Names as in the model file → the graph's tensor names (identity for text graphs)."""
    table = {name: name for name in graph.tensors}
    table.update({source: name for name, source in graph.source_names.items()})
    return table


def _resolve(graph: Graph, name: str, what: str, choices: list[str]) -> str:
    table = internal_names(graph)
    if name not in table:
        listed = ", ".join(sorted(choices)) or "none"
        raise InputError(f"{what} '{name}' does not exist (the model has: {listed})")
    return table[name]


def build_training_graph(forward: Graph, spec: TrainSpec, constants: Collection[str] = ()) -> TrainingGraph:
    """Build the training graph of ``forward`` (a graph imported in training
    mode, whose ``parameters`` are the trainable candidates but ``constants``:
    values the import computed, as a folded ``Pow`` of two constants) under ``spec``.

    Errors: a frozen or output name that does not exist, a loss over a
    non-scalar, a label name that clashes with a tensor of the model."""
    settings = spec.optimizer_settings
    shown = {v: k for k, v in internal_names(forward).items()}
    parameter_names = [shown.get(p, p) for p in forward.parameters]
    frozen = {_resolve(forward, name, "frozen parameter", parameter_names) for name in spec.frozen}
    for name in frozen:
        if name not in forward.parameters:
            raise InputError(f"'{shown.get(name, name)}' is not a parameter (an initializer) of the model")
    taken = set(forward.tensors)

    def fresh(base: str) -> str:
        name = index.fresh_name(base, taken)
        taken.add(name)
        return name

    outputs = [shown.get(o, o) for o in forward.outputs]
    if spec.loss in LOSSES:
        if spec.output is None and len(forward.outputs) != 1:
            raise InputError(f"the model has several outputs ({', '.join(outputs)}); say which one the loss reads")
        prediction = forward.outputs[0] if spec.output is None else _resolve(forward, spec.output, "output", outputs)
        if spec.labels in internal_names(forward):
            raise InputError(f"the label name '{spec.labels}' is already a tensor of the model; choose another")
        if not spec.labels.isidentifier():
            raise InputError(f"the label name '{spec.labels}' is not an identifier")
        taken.add(spec.labels)
        loss = make_loss(spec.loss, forward.tensors[prediction], spec.labels, taken)
        loss_ops, loss_name, labels, stop = list(loss.ops), loss.name, loss.labels, loss.stop
    else:
        loss_name = _resolve(forward, spec.loss, "loss output", outputs)
        shape = forward.tensors[loss_name].shape
        if int(np.prod(shape)) != 1:
            raise ShapeError(
                f"the loss '{spec.loss}' has shape {list(shape)}; a loss must be a scalar "
                f"(or use loss='cross_entropy' / 'mse' on a model output)"
            )
        prediction = forward.outputs[0] if spec.output is None else _resolve(forward, spec.output, "output", outputs)
        loss_ops, labels, stop = [], None, ()
    with_loss = Graph.from_ops([*forward.ops, *loss_ops], parameters=forward.parameters)
    fixed = set(constants)
    candidates = [p for p in forward.parameters if p not in frozen | fixed and p not in forward.state_updates]
    reverse = backward(with_loss, loss_name, candidates, (*stop, *forward.stop_gradients))
    learning_rate = fresh("learning_rate")
    tensors = with_loss.tensors
    optimizer = optimizer_ops(settings, tensors, reverse.gradients, learning_rate, fresh)
    ops = _interleave(forward.ops, loss_ops, reverse.ops, optimizer.shared, optimizer.per_parameter, reverse.gradients)
    updates = {**forward.state_updates, **optimizer.updates}
    graph = Graph.from_ops(
        ops,
        outputs=list(dict.fromkeys([loss_name, prediction, *updates.values()])),
        parameters={**forward.parameters, **optimizer.state},
    )
    return TrainingGraph(
        graph=graph,
        loss=loss_name,
        prediction=prediction,
        labels=labels,
        learning_rate=learning_rate,
        trainable=tuple(reverse.gradients),
        frozen=tuple(p for p in forward.parameters if p not in reverse.gradients and p not in forward.state_updates),
        gradients=dict(reverse.gradients),
        state=dict(optimizer.state),
        updates=updates,
        noise=tuple(forward.noise_inputs),
        saved=tuple(t for t in reverse.saved if t not in graph.parameters),
        data_inputs=tuple(t for t in forward.free_inputs if t.name not in forward.noise_inputs),
        stages={
            "forward": len(forward.ops),
            "loss": len(loss_ops),
            "backward": len(reverse.ops),
            "optimizer": len(optimizer.shared) + sum(len(v) for v in optimizer.per_parameter.values()),
        },
        batch_statistics={name: reverse.adjoints.get(name) for name in forward.batch_statistics},
    )


def _interleave(
    forward: tuple[Op, ...],
    loss: list[Op],
    reverse: tuple[Op, ...],
    shared: list[Op],
    per_parameter: Mapping[str, list[Op]],
    gradients: Mapping[str, str],
) -> list[Op]:
    """All ops in an order where each parameter's update follows its gradient at
    once, so gradients die young (the liveness plan relies on the order)."""
    after = {gradients[p]: ops for p, ops in per_parameter.items()}
    ordered = [*forward, *loss, *shared]
    for op in reverse:
        ordered.append(op)
        ordered.extend(after.get(op.name, []))
    return ordered
