"""Compiled models: run, train_step, save/load, export to ONNX."""

from neoflow.runtime.compiled import CompiledModel, compile, load

__all__ = ["CompiledModel", "compile", "load"]
