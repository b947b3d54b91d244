"""Code generation shared by every target: hardware descriptions, the intrinsic mapper, lattice pieces,
merged nests, implicit matrix products and C-syntax expressions."""

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
