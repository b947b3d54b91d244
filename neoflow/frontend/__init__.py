"""ONNX import: ``load_onnx`` and the custom-op registry."""

from neoflow.frontend.loader import load_onnx, read_model
from neoflow.frontend.registry import register_op

__all__ = ["load_onnx", "read_model", "register_op"]
