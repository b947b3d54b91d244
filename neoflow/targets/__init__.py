"""Targets: one package per target (an emitter or program builder plus what runs it), found by name.

``target(name)`` imports a target's package only when it is asked for, so a
machine without a GPU stack never imports it.  Each package exposes ``TARGET``
(a ``targets.base.Target``)."""

from __future__ import annotations

import importlib

from neoflow.errors import CompileError
from neoflow.targets.base import INTERPRETER, Target

#: target name -> ``module`` holding its ``TARGET``, or ``module:NAME`` (None: the interpreter, in ``targets.base``)
REGISTRY: dict[str, str | None] = {
    "interp": None,
    "cpu": "neoflow.targets.cpu",
    "cuda": "neoflow.targets.cuda:CUDA",
    "tensorcore": "neoflow.targets.cuda:TENSORCORE",
    "npu": "neoflow.targets.npu:NPU",
    "npu-split": "neoflow.targets.npu:NPU_SPLIT",
}


def names() -> tuple[str, ...]:
    """Every target's name."""
    return tuple(REGISTRY)


def check_target(name: str) -> str:
    """``name`` when it names a target, else a ``CompileError`` listing them."""
    if name not in REGISTRY:
        raise CompileError(f"unknown target '{name}' (available: {', '.join(REGISTRY)})")
    return name


def target(name: str) -> Target:
    """The target called ``name`` (its package imported on first use)."""
    module = REGISTRY[check_target(name)]
    if module is None:
        return INTERPRETER
    module, _, attribute = module.partition(":")
    return getattr(importlib.import_module(module), attribute or "TARGET")


__all__ = ["REGISTRY", "Target", "check_target", "names", "target"]
