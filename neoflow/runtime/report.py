"""The compile report: what was compiled and what a run of it will need."""

from __future__ import annotations

from typing import TYPE_CHECKING

from neoflow.autodiff.adjoint import AdjointInfo
from neoflow.targets.memory import nbytes

if TYPE_CHECKING:
    from neoflow.runtime.compiled import CompiledModel


def _shape(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _interpreted(model: CompiledModel) -> list[str]:
    """Lines naming the ops a compiled target left to the interpreter, and why."""
    lines = []
    for role, executor in (("inference", model._run), ("training step", model._train)):
        for op, reason in getattr(executor, "interpreted", {}).items():
            lines.append(f"  {role}: op '{op}' runs in the interpreter ({reason})")
    return lines


def compile_report(model: CompiledModel) -> str:
    """A human-readable report of ``model``: graph sizes, loss and optimizer,
    trainable/frozen parameters, saved activations, gradient forms and memory."""
    name = model.public_name
    inference = model.inference
    lines = [f"neoflow compile report (target {model.target})"]
    lines.append(f"inference: {len(inference.ops)} ops; {model.memory['inference'].summary()}")
    lines.extend(_interpreted(model))
    training = model.training
    if training is None:
        return "\n".join(lines)
    spec = model.spec
    stages = ", ".join(f"{stage} {count}" for stage, count in training.stages.items())
    lines.append(f"training step: {len(training.graph.ops)} ops ({stages})")
    if training.labels is not None:
        lines.append(
            f"loss: {spec.loss} of '{name(training.prediction)}' against '{spec.labels}' "
            f"[{_shape(training.labels.shape)}] {training.labels.dtype}"
        )
    else:
        lines.append(f"loss: the model's output '{spec.loss}'")
    settings = spec.optimizer_settings
    details = [f"lr {model.lr:g}", f"weight decay {settings.weight_decay:g}"]
    if settings.kind == "sgd" and settings.momentum:
        details.append(f"momentum {settings.momentum:g}{' (Nesterov)' if settings.nesterov else ''}")
    if settings.kind in ("adam", "adamw"):
        details.append(f"betas {settings.betas[0]:g}, {settings.betas[1]:g}, eps {settings.eps:g}")
    lines.append(f"optimizer: {settings.kind} ({', '.join(details)})")
    tensors = training.graph.tensors
    count = sum(tensors[p].size for p in training.trainable)
    listed = ", ".join(f"{name(p)} [{_shape(tensors[p].shape)}]" for p in training.trainable)
    lines.append(f"trainable: {len(training.trainable)} tensors, {count} values: {listed}")
    if training.frozen:
        lines.append(f"frozen or not reaching the loss: {', '.join(name(p) for p in training.frozen)}")
    state_updates = [p for p in training.updates if p in model.inference.parameters and p not in training.gradients]
    if state_updates:
        lines.append(f"running statistics updated: {', '.join(name(p) for p in state_updates)}")
    if training.noise:
        lines.append(f"dropout noise inputs (seed {spec.seed}): {', '.join(training.noise)}")
    saved_bytes = sum(nbytes(tensors[t]) for t in training.saved)
    lines.append(
        f"saved for the backward pass: {len(training.saved)} tensors, {saved_bytes} bytes: "
        + ", ".join(name(t) for t in training.saved)
    )
    adjoints = [op for op in training.graph.ops if isinstance(op.info, AdjointInfo)]
    scatters = [op for op in adjoints if op.info.kind == "scatter"]
    lines.append(f"adjoints: {len(adjoints)}, {len(adjoints) - len(scatters)} in gather form")
    for op in scatters:
        lines.append(f"  scatter-add fallback: {op.name} ({op.info.reason})")
    lines.append(f"memory (training step): {model.memory['training'].summary()}")
    return "\n".join(lines)
