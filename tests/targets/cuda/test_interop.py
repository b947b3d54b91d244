"""GPU arrays by ``__cuda_array_interface__`` and DLPack: what the cuda executor reads of them (no GPU
needed: numpy's own DLPack capsules and objects carrying an interface dict stand in)."""

from __future__ import annotations

import numpy as np
import pytest

from neoflow.errors import InputError
from neoflow.targets.cuda.interop import _from_dlpack, device_array, is_device_array


class Interface:
    """An object exposing a ``__cuda_array_interface__`` (as CuPy arrays and torch CUDA tensors do)."""

    def __init__(self, shape, typestr="<f4", strides=None, pointer=4096) -> None:
        self.shape = shape
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (pointer, False),
            "strides": strides,
            "version": 3,
        }


def test_an_interface_gives_pointer_shape_and_dtype() -> None:
    found = device_array(Interface((2, 3), "<f2", pointer=1 << 20), "X")
    assert (found.pointer, found.shape, found.dtype) == (1 << 20, (2, 3), "float16")
    assert device_array(Interface((4,), "<f4", strides=(4,)), "X").dtype == "float32"  # contiguous strides


def test_a_strided_or_untyped_device_array_is_a_one_line_input_error() -> None:
    with pytest.raises(InputError, match="'X' is not contiguous"):
        device_array(Interface((2, 3), "<f4", strides=(4, 8)), "X")
    with pytest.raises(InputError, match="'X' has the GPU dtype complex64"):
        device_array(Interface((2,), "<c8"), "X")


def test_host_arrays_are_not_device_arrays() -> None:
    assert not is_device_array(np.zeros(3))  # numpy's DLPack device is the host
    assert not is_device_array([1.0, 2.0])
    assert is_device_array(Interface((3,)))


def test_a_dlpack_capsule_is_read_without_consuming_it() -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    found = _from_dlpack(array, "X")
    assert (found.pointer, found.shape, found.dtype) == (array.ctypes.data, (3, 4), "float32")
    assert _from_dlpack(np.zeros(5, np.int64), "Y").dtype == "int64"
    view = array[1:]
    assert _from_dlpack(view, "V").pointer == view.ctypes.data  # a byte offset into the buffer
    with pytest.raises(InputError, match="'T' is not contiguous"):
        _from_dlpack(array.T, "T")
