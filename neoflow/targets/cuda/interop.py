"""Arrays already on the GPU, by the two protocols frameworks share: ``__cuda_array_interface__``
(PyTorch CUDA tensors, CuPy, Numba) and DLPack (``__dlpack__`` / ``__dlpack_device__``: PyTorch,
CuPy, JAX).  The cuda executor reads and writes such arrays where they are (zero-copy): it
needs their device pointer, shape, dtype and that they are contiguous.
"""

from __future__ import annotations

import contextlib
import ctypes
from dataclasses import dataclass

import numpy as np

from neoflow.errors import InputError

#: DLPack's device type of CUDA memory (``kDLCUDA``); host memory is 1
DLPACK_CUDA = 2
#: DLPack type codes (``DLDataTypeCode``) -> numpy kind
_DLPACK_KINDS = {0: "i", 1: "u", 2: "f", 4: "bfloat", 6: "b"}


@dataclass(frozen=True)
class DeviceArray:
    """Where a caller's GPU array lies: its device ``pointer``, ``shape`` and numpy ``dtype``
    (``bfloat16`` as the string), and the object itself (kept alive while it is used)."""

    pointer: int
    shape: tuple[int, ...]
    dtype: str
    owner: object


def _torch_tensor(value: object) -> bool:
    """Whether ``value`` is a PyTorch tensor (read through its own attributes: its
    ``__cuda_array_interface__`` builds a dictionary on every call, tens of microseconds that a
    training step reading dozens of tensors through the protocol spends again every step)."""
    return type(value).__module__.startswith("torch") and hasattr(value, "data_ptr") and hasattr(value, "is_cuda")


def is_device_array(value: object) -> bool:
    """Whether ``value`` lies in GPU memory by either protocol (a numpy array or a CPU tensor does not)."""
    if isinstance(value, np.ndarray):
        return False
    if _torch_tensor(value):
        return bool(value.is_cuda)
    # a tensor that requires grad refuses the interface (RuntimeError): its DLPack device still counts
    with contextlib.suppress(RuntimeError):
        if hasattr(value, "__cuda_array_interface__"):
            return True
    device = getattr(value, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) == DLPACK_CUDA
    except Exception:  # a framework whose device query fails: not ours to read
        return False


def device_array(value: object, name: str) -> DeviceArray:
    """The ``DeviceArray`` of GPU array ``value`` (input or output ``name``); an ``InputError``
    where it is not contiguous (row-major) or its type has no neoflow dtype."""
    if _torch_tensor(value) and not value.requires_grad:  # one that does goes through the protocol, which refuses it
        if not value.is_contiguous():
            raise InputError(
                f"'{name}' is not contiguous on the GPU (strides {value.stride()}); pass a contiguous copy"
            )
        dtype = str(value.dtype).removeprefix("torch.")
        if dtype != "bfloat16":
            dtype = _dtype_name(np.dtype(dtype), name)
        return DeviceArray(int(value.data_ptr()), tuple(value.shape), dtype, value)
    try:
        interface = getattr(value, "__cuda_array_interface__", None)
    except RuntimeError as err:  # PyTorch: a tensor that requires grad
        raise InputError(f"'{name}' cannot be read in place ({str(err).splitlines()[0]})") from None
    if interface is not None:
        return _from_interface(value, interface, name)
    return _from_dlpack(value, name)


def _from_interface(value: object, interface: dict, name: str) -> DeviceArray:
    shape = tuple(int(n) for n in interface["shape"])
    dtype = np.dtype(interface["typestr"])
    strides = interface.get("strides")
    if strides is not None and tuple(strides) != _row_major(shape, dtype.itemsize):
        raise InputError(f"'{name}' is not contiguous on the GPU (strides {tuple(strides)}); pass a contiguous copy")
    pointer = int(interface["data"][0])
    return DeviceArray(pointer, shape, _dtype_name(dtype, name), value)


def _row_major(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    strides, step = [], itemsize
    for extent in reversed(shape):
        strides.append(step)
        step *= extent
    return tuple(reversed(strides))


def _dtype_name(dtype: np.dtype, name: str) -> str:
    if dtype.kind == "V" and dtype.itemsize == 2:  # how some exporters type bfloat16
        return "bfloat16"
    if dtype.kind not in "biuf":
        raise InputError(f"'{name}' has the GPU dtype {dtype}, which neoflow has no type for")
    return "bool" if dtype.kind == "b" else dtype.name


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


def _from_dlpack(value: object, name: str) -> DeviceArray:
    """Read the ``DLTensor`` at the head of the capsule ``value.__dlpack__()`` returns; the
    capsule is not consumed (it frees itself, the producer's array stays the caller's)."""
    capsule = value.__dlpack__()
    get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    tensor = _DLTensor.from_address(get_pointer(capsule, b"dltensor"))
    shape = tuple(tensor.shape[k] for k in range(tensor.ndim))
    kind = _DLPACK_KINDS.get(tensor.dtype.code)
    if kind is None or tensor.dtype.lanes != 1:
        raise InputError(f"'{name}' has a DLPack type (code {tensor.dtype.code}) neoflow has no type for")
    if kind == "bfloat":
        dtype = "bfloat16"
        itemsize = 2
    else:
        numpy_dtype = np.dtype(f"{kind}{tensor.dtype.bits // 8}") if kind != "b" else np.dtype(bool)
        dtype, itemsize = _dtype_name(numpy_dtype, name), numpy_dtype.itemsize
    if tensor.strides:
        strides = tuple(tensor.strides[k] * itemsize for k in range(tensor.ndim))
        if any(n > 1 and s != r for n, s, r in zip(shape, strides, _row_major(shape, itemsize), strict=True)):
            raise InputError(f"'{name}' is not contiguous on the GPU; pass a contiguous copy")
    pointer = int(tensor.data or 0) + int(tensor.byte_offset)
    return DeviceArray(pointer, shape, dtype, (value, capsule))
