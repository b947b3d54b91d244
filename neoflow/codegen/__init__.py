"""Code generation: lowering to loop nests (isl), hardware descriptions, intrinsic mapping, C emission."""

from neoflow.codegen.hardware import AVX2, NPU_CUBE, PORTABLE, TENSOR_CORE, Hardware, Intrinsic, hardware
from neoflow.codegen.mapping import Mapping, check_mapping, mappings

__all__ = [
    "AVX2",
    "NPU_CUBE",
    "PORTABLE",
    "TENSOR_CORE",
    "Hardware",
    "Intrinsic",
    "Mapping",
    "check_mapping",
    "hardware",
    "mappings",
]
