"""CUDA C++ to a cubin with NVRTC (NVIDIA's runtime compiler, through ``cuda-bindings``), cached on disk.

Compiling needs NVRTC and the CUDA headers (the ``nvidia-cuda-nvrtc`` and
``nvidia-cuda-runtime`` wheels of ``neoflow[cuda]``), not a GPU or a driver, so
a CPU-only machine builds the cubins a GPU later runs.  The cache key is the
source, the architecture, the options and NVRTC's version; a cubin is stored with its SHA-256
beside it and built again where its bytes no longer match (``targets.cache.seal``).
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from neoflow.errors import CompileError
from neoflow.targets.cache import cache_dir, entry_lock, intact, store_sealed, write_atomically

#: options every kernel is built with (``-Xptxas=-v`` makes ptxas report registers and spills)
OPTIONS = ("--std=c++17", "-default-device", "-Xptxas=-v", "--extra-device-vectorization")
MISSING = "NVRTC is not installed (pip install 'neoflow[cuda]': cuda-bindings and the nvidia-cuda-nvrtc wheel)"
_SPILLS = re.compile(
    r"Function properties for (\w+)\s*\n.*?(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads"
)
_REGISTERS = re.compile(r"Compiling entry function '(\w+)'.*?Used (\d+) registers", re.S)


@dataclass(frozen=True)
class Cubin:
    """A compiled module: its ``path``, the compile ``log``, the ``arch`` it was built for,
    and per kernel the registers a thread uses and the bytes it spills (stores)."""

    path: Path
    log: str
    arch: str
    registers: dict[str, int]
    spills: dict[str, int]


def _nvrtc():
    try:
        from cuda.bindings import nvrtc
    except ImportError as err:  # pragma: no cover - the extra is installed in CI
        raise CompileError(MISSING) from err
    return nvrtc


def available() -> bool:
    """Whether NVRTC can be loaded here."""
    try:
        _nvrtc().nvrtcVersion()
    except (CompileError, RuntimeError, OSError):
        return False
    return True


@cache
def version() -> str:
    """NVRTC's version, ``major.minor``."""
    err, major, minor = _nvrtc().nvrtcVersion()
    _check(err, "nvrtcVersion")
    return f"{major}.{minor}"


@cache
def include_dir() -> str:
    """The directory of the CUDA headers (``cuda_fp16.h``) NVRTC compiles against."""
    try:
        import cuda.pathfinder

        found = cuda.pathfinder.find_nvidia_header_directory("cudart")
    except (ImportError, RuntimeError, OSError):
        found = None
    if found is None:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
        candidate = Path(home) / "include"
        found = str(candidate) if (candidate / "cuda_fp16.h").is_file() else None
    if found is None:
        raise CompileError("the CUDA headers are not installed (pip install 'neoflow[cuda]': nvidia-cuda-runtime)")
    return found


def _check(err, call: str) -> None:
    nvrtc = _nvrtc()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"{call} failed: {nvrtc.nvrtcGetErrorString(err)[1].decode()}")


def _log(nvrtc, program) -> str:
    _err, size = nvrtc.nvrtcGetProgramLogSize(program)
    buffer = b" " * size
    nvrtc.nvrtcGetProgramLog(program, buffer)
    return buffer.decode(errors="replace").rstrip("\x00 \n")


def _parse(log: str) -> tuple[dict[str, int], dict[str, int]]:
    registers = {name: int(count) for name, count in _REGISTERS.findall(log)}
    spills = {name: int(stores) for name, _, stores, _ in _SPILLS.findall(log)}
    return registers, spills


def compile_cubin(source: str, arch: str = "sm_90", name: str = "neoflow.cu") -> Cubin:
    """``source`` compiled for ``arch`` (``sm_90``, ``sm_80``, ...; a source holding Hopper's
    ``wgmma`` is built for ``sm_90a``, the architecture-specific target it needs); from the
    cache when it is there.  A compile error is a ``CompileError`` with the first lines of
    NVRTC's log."""
    _nvrtc()  # NVRTC missing: the error that says how to install it, before anything else
    build = f"{arch}a" if arch == "sm_90" and "wgmma.mma_async" in source else arch
    options = (f"--gpu-architecture={build}", f"-I{include_dir()}", *OPTIONS)
    key = hashlib.sha256("\0".join([source, *options, version()]).encode()).hexdigest()[:32]
    directory = cache_dir() / "cubins"
    path, log_path = directory / f"{key}.cubin", directory / f"{key}.log"
    if not (intact(path) and log_path.is_file()):
        with entry_lock(path):
            if not (intact(path) and log_path.is_file()):  # not built by another process meanwhile
                binary, log = _nvrtc_compile(source, name, options, arch)
                write_atomically(log_path, log.encode())
                store_sealed(path, binary)
    log = log_path.read_text()
    return Cubin(path, log, arch, *_parse(log))


def _nvrtc_compile(source: str, name: str, options: tuple[str, ...], arch: str) -> tuple[bytes, str]:
    """The cubin NVRTC builds of ``source`` and its log."""
    nvrtc = _nvrtc()
    err, program = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    _check(err, "nvrtcCreateProgram")
    try:
        encoded = [o.encode() for o in options]
        (err,) = nvrtc.nvrtcCompileProgram(program, len(encoded), encoded)
        log = _log(nvrtc, program)
        if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            head = "; ".join(line for line in log.splitlines() if "error" in line)[:600]
            raise CompileError(f"NVRTC could not compile the generated CUDA for {arch}: {head or log[:600]}")
        err, size = nvrtc.nvrtcGetCUBINSize(program)
        _check(err, "nvrtcGetCUBINSize")
        binary = b" " * size
        (err,) = nvrtc.nvrtcGetCUBIN(program, binary)
        _check(err, "nvrtcGetCUBIN")
    finally:
        nvrtc.nvrtcDestroyProgram(program)
    return binary, log
