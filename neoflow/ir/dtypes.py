"""Element types of tensors and expressions.

A dtype is one of the names in ``DTYPES``.  Literals and index values are
*weak*: they take the type of the strong operand they meet (``A[i] * 2`` stays
float16 when ``A`` is float16), and become ``int64``/``float32`` when nothing
strong is around.
"""

from __future__ import annotations

import ml_dtypes  # ships with onnx: bfloat16, float8, float4 and sub-byte integer storage types
import numpy as np

from neoflow.errors import ParseError

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "int8": np.dtype(np.int8),
    "int16": np.dtype(np.int16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "uint32": np.dtype(np.uint32),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
    # storage-only types (ONNX's bfloat16, float8, float4, int4/int2): computed in float32 / int32
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8e4m3fnuz": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "float8e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "float8e5m2fnuz": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "float4e2m1": np.dtype(ml_dtypes.float4_e2m1fn),
    "int4": np.dtype(ml_dtypes.int4),
    "uint4": np.dtype(ml_dtypes.uint4),
    "int2": np.dtype(ml_dtypes.int2),
    "uint2": np.dtype(ml_dtypes.uint2),
}
STORAGE_FLOATS = ("bfloat16", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz", "float4e2m1")
STORAGE_INTS = ("int4", "uint4", "int2", "uint2")
WEAK_INT = "weak_int"
WEAK_FLOAT = "weak_float"
DEFAULT_FLOAT = "float32"
#: the float dtypes arithmetic is carried out in: a weakly typed float meeting one is computed in it
WIDE_FLOATS = ("float32", "float64")

_FLOATS = (
    "float16",
    "float32",
    "float64",
    "bfloat16",
    "float8e4m3fn",
    "float8e4m3fnuz",
    "float8e5m2",
    "float8e5m2fnuz",
    "float4e2m1",
)
_INTS = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "int4", "uint4", "int2", "uint2")


def check_dtype(name: str) -> str:
    """Return ``name`` if it is a known dtype, else raise ``ParseError``."""
    if name not in DTYPES:
        raise ParseError(f"unknown dtype '{name}' (known: {', '.join(DTYPES)})")
    return name


def is_float(dtype: str) -> bool:
    """True for float dtypes, weak or strong."""
    return dtype in _FLOATS or dtype == WEAK_FLOAT


def concrete(dtype: str) -> str:
    """Turn a weak dtype into the strong one it defaults to."""
    return {WEAK_INT: "int64", WEAK_FLOAT: DEFAULT_FLOAT}.get(dtype, dtype)


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a (possibly weak) neoflow dtype."""
    return DTYPES[concrete(dtype)]


def compute_dtype(dtype: str) -> np.dtype:
    """The numpy dtype arithmetic on ``dtype`` values is carried out in
    (float32 / int32 for the storage-only types)."""
    name = concrete(dtype)
    if name in STORAGE_FLOATS:
        return DTYPES["float32"]
    if name in STORAGE_INTS:
        return DTYPES["int32"]
    return DTYPES[name]


def _rank(dtype: str) -> tuple[int, int]:
    kind = 2 if dtype in _FLOATS else 1 if dtype in _INTS else 0
    order = {
        "bool": 0,
        "int8": 1,
        "uint8": 1,
        "int16": 2,
        "uint16": 2,
        "int32": 3,
        "uint32": 3,
        "int64": 4,
        "uint64": 4,
        "float16": 1,
        "float32": 2,
        "float64": 3,
    }
    return kind, order.get(dtype, 1)  # the storage-only floats: narrow, as float16 is


def promote(a: str, b: str) -> str:
    """The dtype of an arithmetic result of operands of dtypes ``a`` and ``b``."""
    weak = {WEAK_INT, WEAK_FLOAT}
    if a in weak and b in weak:
        return WEAK_FLOAT if WEAK_FLOAT in (a, b) else WEAK_INT
    if a in weak or b in weak:
        weak_one, strong = (a, b) if a in weak else (b, a)
        if weak_one == WEAK_FLOAT and not is_float(strong):
            return DEFAULT_FLOAT
        if strong == "bool":
            return weak_one
        return strong
    if a != b and is_float(a) and is_float(b) and _rank(a) == _rank(b):
        return DEFAULT_FLOAT  # two different narrow floats (float16 and bfloat16): neither holds the other
    return max(a, b, key=_rank)


def to_float(dtype: str) -> str:
    """The dtype a float-only function (exp, log, ...) returns for this input."""
    return dtype if is_float(dtype) else WEAK_FLOAT if dtype in (WEAK_INT, "bool") else DEFAULT_FLOAT
