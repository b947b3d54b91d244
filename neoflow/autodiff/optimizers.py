"""Optimizers as tensor-expression ops: SGD (with momentum, Nesterov), Adam, AdamW.

Each optimizer turns a parameter ``P`` and its gradient into ops computing the
parameter's next value (and the next values of its state tensors: momenta, the
step counter).  The formulas follow PyTorch's ``torch.optim`` so that a model
trained by neoflow and by PyTorch from the same start takes the same steps.
The learning rate is a scalar input, so a schedule needs no recompilation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from neoflow.errors import InputError
from neoflow.ir.index import index_vars
from neoflow.ir.op import Op, Tensor
from neoflow.ir.text import build_statement

OPTIMIZERS = ("sgd", "momentum", "nesterov", "adam", "adamw")


@dataclass(frozen=True)
class OptimizerSettings:
    """An optimizer and its hyper-parameters.

    ``kind`` is one of ``sgd`` (with ``momentum`` > 0 it keeps a momentum
    buffer), ``momentum`` (SGD with momentum, default 0.9), ``nesterov``,
    ``adam`` or ``adamw``.  ``weight_decay`` is L2 regularisation added to the
    gradient, except for AdamW where it is decoupled (``P -= lr * wd * P``)."""

    kind: str = "sgd"
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def normalised(self) -> OptimizerSettings:
        """The settings with ``momentum``/``nesterov`` kinds spelled out; checks values."""
        if self.kind not in OPTIMIZERS:
            raise InputError(f"unknown optimizer '{self.kind}' (choose from {', '.join(OPTIMIZERS)})")
        momentum, nesterov = self.momentum, self.nesterov
        if self.kind in ("momentum", "nesterov"):
            momentum = momentum or 0.9
            nesterov = nesterov or self.kind == "nesterov"
        if not 0 <= momentum < 1 or not all(0 <= b < 1 for b in self.betas) or self.eps <= 0:
            raise InputError("optimizer settings out of range: need 0 <= momentum, betas < 1 and eps > 0")
        if nesterov and momentum == 0:
            raise InputError("Nesterov momentum needs momentum > 0")
        if self.weight_decay < 0:
            raise InputError(f"weight decay must be >= 0, got {self.weight_decay}")
        kind = "sgd" if self.kind in ("momentum", "nesterov") else self.kind
        return OptimizerSettings(kind, momentum, nesterov, self.weight_decay, tuple(self.betas), self.eps)


@dataclass
class OptimizerOps:
    """What an optimizer adds to a training graph: ``shared`` ops (step counter,
    bias corrections), ``per_parameter`` ops by parameter, the ``state`` tensors
    with their initial values, and ``updates`` (tensor → tensor holding its next value)."""

    shared: list[Op] = field(default_factory=list)
    per_parameter: dict[str, list[Op]] = field(default_factory=dict)
    state: dict[str, np.ndarray] = field(default_factory=dict)
    updates: dict[str, str] = field(default_factory=dict)


def optimizer_ops(
    settings: OptimizerSettings,
    parameters: Mapping[str, Tensor],
    gradients: Mapping[str, str],
    learning_rate: str,
    fresh: Callable[[str], str],
) -> OptimizerOps:
    """Ops updating each parameter in ``gradients`` (parameter → gradient tensor
    name) with ``settings``; ``learning_rate`` names the scalar input holding
    the rate and ``fresh`` makes new tensor names."""
    s = settings.normalised()
    result = OptimizerOps()
    tensors: dict[str, Tensor] = {learning_rate: Tensor(learning_rate, (), "float32")}

    def add(target: list[Op], name: str, shape: tuple[int, ...], body: str) -> str:
        variables = ", ".join(index_vars(len(shape)))
        text = f"{name}[{variables}] = {body.replace('[@]', f'[{variables}]')}"
        op = build_statement(text, tensors, shape, "float32")
        tensors[name] = op.output
        target.append(op)
        return name

    def state(name: str, shape: tuple[int, ...]) -> str:
        tensors[name] = Tensor(name, shape, "float32")
        result.state[name] = np.zeros(shape, np.float32)
        return name

    lr = f"{learning_rate}[]"
    if s.kind in ("adam", "adamw"):
        b1, b2 = s.betas
        step = state(fresh("adam_step"), ())
        step_next = add(result.shared, fresh("adam_step_next"), (), f"{step}[] + 1")
        result.updates[step] = step_next
        scale = add(result.shared, fresh("adam_scale"), (), f"{lr} / (1 - pow({b1!r}, {step_next}[]))")
        root = add(result.shared, fresh("adam_root"), (), f"sqrt(1 - pow({b2!r}, {step_next}[]))")
    for name, grad in gradients.items():
        tensor = parameters[name]
        tensors[name], tensors[grad] = tensor, Tensor(grad, tensor.shape, tensor.dtype)
        ops: list[Op] = []
        shape = tensor.shape
        g = f"{grad}[@]"
        if s.weight_decay and s.kind != "adamw":
            g = add(ops, fresh(f"{name}_decayed_grad"), shape, f"{g} + {s.weight_decay!r} * {name}[@]") + "[@]"
        if s.kind == "sgd":
            step_direction = g
            if s.momentum:
                buffer = state(fresh(f"{name}_momentum"), shape)
                buffer_next = add(ops, fresh(f"{name}_momentum_next"), shape, f"{s.momentum!r} * {buffer}[@] + {g}")
                result.updates[buffer] = buffer_next
                step_direction = f"({g} + {s.momentum!r} * {buffer_next}[@])" if s.nesterov else f"{buffer_next}[@]"
            new = f"{name}[@] - {lr} * {step_direction}"
        else:
            m, v = state(fresh(f"{name}_adam_m"), shape), state(fresh(f"{name}_adam_v"), shape)
            m_next = add(ops, fresh(f"{name}_adam_m_next"), shape, f"{b1!r} * {m}[@] + {1 - b1!r} * {g}")
            v_next = add(ops, fresh(f"{name}_adam_v_next"), shape, f"{b2!r} * {v}[@] + {1 - b2!r} * {g} * {g}")
            result.updates[m], result.updates[v] = m_next, v_next
            kept = (
                f"{name}[@] * (1 - {lr} * {s.weight_decay!r})" if s.kind == "adamw" and s.weight_decay else f"{name}[@]"
            )
            new = f"{kept} - {scale}[] * {m_next}[@] / (sqrt({v_next}[@]) / {root}[] + {s.eps!r})"
        result.updates[name] = add(ops, fresh(f"{name}_next"), shape, new)
        result.per_parameter[name] = ops
    return result
