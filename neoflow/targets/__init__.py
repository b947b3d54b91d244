"""Targets: one package per target (an emitter or program builder plus what runs it), found by name.

``target(name)`` imports a target's package only when it is asked for, so a
machine without a GPU stack never imports it.  Each package exposes ``TARGET``
(a ``targets.base.Target``).  A target whose machine is data also takes a
description file: ``npu:my_machine.json`` is the NPU model of that machine."""

from __future__ import annotations

import importlib
from pathlib import Path

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


#: target name -> ``module:function`` making its ``Target`` for a machine description file (``<name>:<file>``)
FILE_TARGETS: dict[str, str] = {"npu": "neoflow.targets.npu:machine_target"}


def names() -> tuple[str, ...]:
    """Every target's name."""
    return tuple(REGISTRY)


def machine_file(name: str) -> str | None:
    """The machine description file a ``<target>:<file>`` name carries, else None."""
    base, colon, path = name.partition(":")
    return path if colon and base in FILE_TARGETS and path else None


def with_machine_file(name: str, path: str | Path) -> str:
    """``name`` (a ``<target>:<file>`` name) with its file replaced by ``path``."""
    return f"{name.partition(':')[0]}:{path}"


def check_target(name: str) -> str:
    """``name`` when it names a target (a machine file's too, read and checked), else a ``CompileError``."""
    if name in REGISTRY:
        return name
    if machine_file(name) is not None:
        target(name)
        return name
    files = ", ".join(f"{base}:<machine.json>" for base in FILE_TARGETS)
    raise CompileError(f"unknown target '{name}' (available: {', '.join(REGISTRY)}, or {files})")


def target(name: str) -> Target:
    """The target called ``name`` (its package imported on first use)."""
    path = machine_file(name)
    if path is not None:
        module, _, function = FILE_TARGETS[name.partition(":")[0]].partition(":")
        return getattr(importlib.import_module(module), function)(path)
    module = REGISTRY[check_target(name)]
    if module is None:
        return INTERPRETER
    module, _, attribute = module.partition(":")
    return getattr(importlib.import_module(module), attribute or "TARGET")


__all__ = ["FILE_TARGETS", "REGISTRY", "Target", "check_target", "machine_file", "names", "target", "with_machine_file"]
