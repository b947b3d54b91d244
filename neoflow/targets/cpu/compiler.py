"""Compile generated C with the system C compiler into a cached shared library.

The library is cached under ``$NEOFLOW_CACHE_DIR`` (default ``~/.cache/neoflow``)
in ``kernels/<hash>.so``, the hash covering the source, the compiler command, the
flags and the compiler's version; the source is kept beside it.  A build goes to a temporary
file that is renamed into place, so two processes compiling the same source at
once both end with a complete library.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from neoflow.errors import CompileError
from neoflow.targets.cache import cache_dir

# -fno-math-errno: the kernels never read errno, and a math function that may set it cannot be hoisted
# out of a loop or vectorised (an Adam update recomputed pow(beta, step) at every element)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
LIBRARIES = ("-lm",)
ERROR_LINES = 6


def compiler() -> str:
    """The C compiler command (``$CC`` or ``cc``); a missing one is a ``CompileError``."""
    command = os.environ.get("CC", "cc")
    if shutil.which(shlex.split(command)[0]) is None:
        raise CompileError(
            f"no C compiler found ('{command}'); install gcc or clang (or set CC), or use target='interp'"
        )
    return command


@cache
def _version(command: str) -> str:
    result = subprocess.run([*shlex.split(command), "--version"], capture_output=True, text=True, check=False)
    return (result.stdout or result.stderr).splitlines()[0] if (result.stdout or result.stderr) else "unknown"


def build_library(source: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The path of a shared library built from ``source`` (from the cache when it is there)."""
    command = compiler()
    flags = (*FLAGS, *extra_flags)
    # the command itself too: a wrapper or a CC with its own flags builds different code from the same compiler
    key = hashlib.sha256("\0".join([source, command, *flags, _version(command)]).encode()).hexdigest()[:32]
    directory = cache_dir() / "kernels"
    library = directory / f"{key}.so"
    if library.is_file():
        return library
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{key}.c").write_text(source)
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".so")
    os.close(handle)
    try:
        result = subprocess.run(
            [*shlex.split(command), *flags, "-x", "c", "-", "-o", temporary, *LIBRARIES],
            input=source,
            capture_output=True,
            text=True,
            check=False,
        )
        if result.returncode != 0:
            lines = [line for line in result.stderr.splitlines() if line.strip()][:ERROR_LINES]
            raise CompileError(
                f"the C compiler failed (exit {result.returncode}; source {directory / f'{key}.c'}): "
                + " | ".join(lines)
            )
        os.replace(temporary, library)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return library


def load_library(source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or fetch from the cache) and load the library of ``source``."""
    return ctypes.CDLL(str(build_library(source, extra_flags)))
