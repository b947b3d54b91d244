"""The CUDA driver API through NVIDIA's ``cuda-bindings``: the device, modules, memory, launches, graphs.

Every call's status is checked; a failure is a ``neoflow`` error naming the call
(a missing driver or GPU says so in one line).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from dataclasses import dataclass
from functools import cache

import numpy as np

from neoflow.errors import CompileError, NeoflowError


class DeviceError(NeoflowError):
    """The GPU, its driver or a call to it failed."""

    kind = "cuda error"


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError as err:
        raise DeviceError("cuda-bindings is not installed (pip install 'neoflow[cuda]')") from err
    return driver


def check(result, call: str):
    """The values a driver call returned after its status, or a ``DeviceError`` naming ``call``."""
    driver = _driver()
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise DeviceError(f"{call} failed: {name.decode() if name else err}")
    return values[0] if len(values) == 1 else tuple(values)


@dataclass
class Device:
    """The GPU (``NEOFLOW_CUDA_DEVICE``, default 0) with its primary context current, its
    architecture (``sm_90``) and name."""

    handle: object
    context: object
    arch: str
    name: str
    stream: object


@cache
def device() -> Device:
    """The GPU (initialised once); a missing driver or GPU is a ``DeviceError``."""
    driver = _driver()
    try:
        check(driver.cuInit(0), "cuInit")
    except DeviceError as err:
        raise DeviceError(f"no usable NVIDIA driver or GPU ({err.message})") from err
    except (RuntimeError, OSError) as err:  # cuda-bindings found no libcuda: no driver installed
        raise DeviceError(
            "no NVIDIA driver is installed (libcuda was not found); the cuda target runs on a GPU"
        ) from err
    count = check(driver.cuDeviceGetCount(), "cuDeviceGetCount")
    if count == 0:
        raise DeviceError("no NVIDIA GPU is present")
    ordinal = os.environ.get("NEOFLOW_CUDA_DEVICE", "0")
    if not ordinal.isdigit() or int(ordinal) >= count:
        raise DeviceError(f"NEOFLOW_CUDA_DEVICE={ordinal} names no GPU of the {count} present")
    handle = check(driver.cuDeviceGet(int(ordinal)), "cuDeviceGet")
    context = check(driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
    check(driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")
    attribute = driver.CUdevice_attribute
    major = check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, handle), "attr")
    minor = check(driver.cuDeviceGetAttribute(attribute.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, handle), "attr")
    name = check(driver.cuDeviceGetName(64, handle), "cuDeviceGetName").split(b"\0")[0].decode()
    stream = check(driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value), "cuStreamCreate")
    return Device(handle, context, f"sm_{major}{minor}", name, stream)


def make_current(device: Device) -> None:
    """Make ``device``'s context current on the calling thread (a context is current per thread: a
    framework's autograd engine runs a backward pass on a thread of its own)."""
    check(_driver().cuCtxSetCurrent(device.context), "cuCtxSetCurrent")


def default_arch() -> str:
    """The architecture to compile for: ``NEOFLOW_CUDA_ARCH``, else the GPU's when one answers, else ``sm_90``."""
    chosen = os.environ.get("NEOFLOW_CUDA_ARCH")
    if chosen:
        return chosen
    try:
        return device().arch
    except DeviceError:
        return "sm_90"


class Module:
    """A loaded cubin and its kernels by name."""

    def __init__(self, cubin: bytes) -> None:
        driver = _driver()
        device()
        self.handle = check(driver.cuModuleLoadData(cubin), "cuModuleLoadData")
        self.functions: dict[str, object] = {}

    def function(self, name: str, shared: int = 0):
        """Kernel ``name``, allowed ``shared`` bytes of dynamic shared memory."""
        driver = _driver()
        if name not in self.functions:
            self.functions[name] = check(driver.cuModuleGetFunction(self.handle, name.encode()), "cuModuleGetFunction")
        if shared > 48 << 10:
            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(self.functions[name], attribute, shared), "cuFuncSetAttribute")
        return self.functions[name]


class Buffer:
    """``nbytes`` of device memory (at least one byte), freed with the object."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.pointer = int(check(_driver().cuMemAlloc(max(nbytes, 1)), "cuMemAlloc"))

    def upload(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array)
        if data.nbytes != self.nbytes:
            raise CompileError(f"an upload of {data.nbytes} bytes into a buffer of {self.nbytes}")
        check(_driver().cuMemcpyHtoD(self.pointer, data.ctypes.data, data.nbytes), "cuMemcpyHtoD")

    def download(self, shape, dtype) -> np.ndarray:
        out = np.empty(shape, dtype)
        check(_driver().cuMemcpyDtoH(out.ctypes.data, self.pointer, out.nbytes), "cuMemcpyDtoH")
        return out

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            _driver().cuMemFree(self.pointer)


class View:
    """``nbytes`` at ``offset`` into ``buffer`` (an intermediate's place in the arena)."""

    def __init__(self, buffer: Buffer, offset: int, nbytes: int) -> None:
        self.buffer = buffer  # kept alive as long as the view
        self.nbytes = nbytes
        self.pointer = buffer.pointer + offset


def launch(
    function, grid, threads: int, shared: int, pointers: list[int], stream, priority: int
) -> tuple[np.ndarray, np.ndarray]:
    """Launch ``function`` on ``grid`` blocks of ``threads`` with device ``pointers`` as its
    arguments, at scheduling ``priority`` (a CUDA stream priority: a captured graph keeps it per
    kernel); returns the argument values and their addresses (keep them alive until the launch
    is captured or done)."""
    driver = _driver()
    values = np.array(pointers, dtype=np.uint64)
    addresses = np.array([values.ctypes.data + 8 * k for k in range(len(pointers))], dtype=np.uint64)
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes, config.hStream = shared, stream
    attribute = driver.CUlaunchAttribute()
    attribute.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PRIORITY
    attribute.value.priority = priority
    config.attrs, config.numAttrs = [attribute], 1
    check(driver.cuLaunchKernelEx(config, function, addresses.ctypes.data, 0), "cuLaunchKernelEx")
    return values, addresses


@cache
def priority_range() -> tuple[int, int]:
    """The current context's ``(least, greatest)`` stream priorities (greatest is the lower number)."""
    return tuple(check(_driver().cuCtxGetStreamPriorityRange(), "cuCtxGetStreamPriorityRange"))


def synchronize(stream) -> None:
    check(_driver().cuStreamSynchronize(stream), "cuStreamSynchronize")


class Lanes:
    """``count`` streams (the first is ``stream``, the capturing one) and ``events`` events for work
    that may run at once: inside a stream capture, an event recorded on one lane and waited for on
    another becomes an edge of the CUDA graph, and work on different lanes with no path of such
    edges between it runs in parallel branches."""

    def __init__(self, stream, count: int, events: int) -> None:
        driver = _driver()
        flags = driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value
        self.streams = [stream] + [check(driver.cuStreamCreate(flags), "cuStreamCreate") for _ in range(count - 1)]
        disable = driver.CUevent_flags.CU_EVENT_DISABLE_TIMING.value
        self.start = check(driver.cuEventCreate(disable), "cuEventCreate")
        self.events = [check(driver.cuEventCreate(disable), "cuEventCreate") for _ in range(events)]

    def fork(self, count: int) -> None:
        """Lanes 1 to ``count - 1`` start after the work queued on lane 0 so far."""
        driver = _driver()
        check(driver.cuEventRecord(self.start, self.streams[0]), "cuEventRecord")
        for stream in self.streams[1:count]:
            check(driver.cuStreamWaitEvent(stream, self.start, 0), "cuStreamWaitEvent")

    def record(self, event: int, lane: int) -> None:
        """Event ``event`` marks the work queued on ``lane`` so far."""
        check(_driver().cuEventRecord(self.events[event], self.streams[lane]), "cuEventRecord")

    def wait(self, lane: int, event: int) -> None:
        """Work queued on ``lane`` from now on follows what event ``event`` marks."""
        check(_driver().cuStreamWaitEvent(self.streams[lane], self.events[event], 0), "cuStreamWaitEvent")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the bindings may be gone already
            driver = _driver()
            for event in (self.start, *self.events):
                driver.cuEventDestroy(event)
            for stream in self.streams[1:]:
                driver.cuStreamDestroy(stream)


def synchronize_context() -> None:
    """Wait for all work queued on the GPU (in every stream of the context)."""
    check(_driver().cuCtxSynchronize(), "cuCtxSynchronize")


def memset_zero(pointer: int, nbytes: int, stream) -> None:
    check(_driver().cuMemsetD8Async(pointer, 0, nbytes, stream), "cuMemsetD8Async")


class Graph:
    """The launches a function makes on ``stream``, captured once as a CUDA graph and replayed."""

    def __init__(self, record, stream) -> None:
        driver = _driver()
        self.stream = stream
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        check(driver.cuStreamBeginCapture(stream, mode), "cuStreamBeginCapture")
        try:
            self.kept = record()
        finally:
            graph = check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")
        self.graph = graph
        # each kernel runs at the priority it was launched with (not the replaying stream's)
        flags = driver.CUgraphInstantiate_flags.CUDA_GRAPH_INSTANTIATE_FLAG_USE_NODE_PRIORITY.value
        self.executable = check(driver.cuGraphInstantiate(graph, flags), "cuGraphInstantiate")

    def replay(self, stream: object = None) -> None:
        """Launch the graph on ``stream`` (a ``CUstream``; None: the one it was captured on)."""
        check(_driver().cuGraphLaunch(self.executable, self.stream if stream is None else stream), "cuGraphLaunch")


def as_stream(handle: int) -> object:
    """A caller's stream (its handle, as ``torch.cuda.Stream.cuda_stream`` gives it) as a ``CUstream``."""
    return _driver().CUstream(int(handle))


def time_replays(graph: Graph, repeats: int) -> list[float]:
    """Seconds of each of ``repeats`` replays of ``graph``, by CUDA events around each."""
    driver = _driver()
    events = [check(driver.cuEventCreate(0), "cuEventCreate") for _ in range(repeats + 1)]
    check(driver.cuEventRecord(events[0], graph.stream), "cuEventRecord")
    for k in range(repeats):
        graph.replay()
        check(driver.cuEventRecord(events[k + 1], graph.stream), "cuEventRecord")
    synchronize(graph.stream)
    times = [check(driver.cuEventElapsedTime(a, b), "cuEventElapsedTime") / 1e3 for a, b in itertools.pairwise(events)]
    for event in events:
        driver.cuEventDestroy(event)
    return times
