"""Compile generated C with the system C compiler into a cached shared library.

The library is cached under ``$NEOFLOW_CACHE_DIR`` (default ``~/.cache/neoflow``)
in ``kernels/<hash>.so``, the hash covering the source, the compiler command, the
flags and the compiler's version; the source is kept beside it.  A build goes to a temporary
file that is renamed into place, after its SHA-256 is written beside it
(``targets.cache.seal``), under a lock on the entry: processes compiling the same source at once
take turns and the second finds it built, no process ever loads half a library, and an entry whose
bytes no longer match their digest (truncated, corrupted) is built again.

A large source whose top-level functions the generator separated with ``UNIT`` lines is
compiled as several translation units at once (one compiler process per core), each the
source's header (what precedes the first ``UNIT``), prototypes of every exported function,
and a share of the functions; the objects are cached by their own source (a model whose
kernels mostly did not change recompiles only those that did) and linked into the library.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from neoflow.errors import CompileError
from neoflow.targets.cache import cache_dir, entry_lock, intact, seal, write_atomically

# -fno-math-errno: the kernels never read errno, and a math function that may set it cannot be hoisted
# out of a loop or vectorised (an Adam update recomputed pow(beta, step) at every element)
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
LIBRARIES = ("-lm",)


@cache
def vector_math() -> bool:
    """Whether loops calling ``expf``, ``erff``, ``tanhf``, ``logf``, ``powf`` (and the double ones) may be
    vectorised with glibc's vector math library (libmvec, glibc 2.35+ on x86-64: erf and tanh came in
    2.35): the prelude then declares those functions SIMD-callable (``NF_VECTOR_MATH``) and the link adds
    ``-lmvec``.  Scalar, a GELU's ``erff`` costs as much as the rest of a ViT block's element-wise work
    ten times over (15.7 against 1.5 ms for 2M elements here); the vector versions are as accurate
    (glibc documents at most 4 ulp for both).  ``NEOFLOW_VECTOR_MATH=0`` turns it off."""
    import ctypes.util
    import platform

    if os.environ.get("NEOFLOW_VECTOR_MATH", "1") == "0" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    name, version = platform.libc_ver()
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    return name == "glibc" and parts >= (2, 35) and ctypes.util.find_library("mvec") is not None


def _math_flags() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The compile flags and link libraries vector math adds (``vector_math``)."""
    return (("-DNF_VECTOR_MATH",), ("-lmvec",)) if vector_math() else ((), ())


ERROR_LINES = 6
#: the line separating top-level functions a build may put in different translation units
UNIT = "\n/* nf-unit */\n"
#: below this much source (bytes), one translation unit: a compiler process and a link cost more
UNIT_BYTES = 200_000
#: an exported (not static) function's one-line definition in generated code
_EXPORTED = re.compile(r"^((?!static)[A-Za-z_][\w \t\*]*?\b(nf_\w+)\([^;{}]*\))\s*\{\s*$", re.M)


def compiler() -> str:
    """The C compiler command (``$CC`` or ``cc``); a missing one is a ``CompileError``."""
    command = os.environ.get("CC", "cc")
    if shutil.which(shlex.split(command)[0]) is None:
        raise CompileError(
            f"no C compiler found ('{command}'); install gcc or clang (or set CC), or use target='interp'"
        )
    return command


@cache
def version(command: str) -> str:
    """The first line of ``command --version`` (part of every cache key: another compiler, other code)."""
    result = subprocess.run([*shlex.split(command), "--version"], capture_output=True, text=True, check=False)
    return (result.stdout or result.stderr).splitlines()[0] if (result.stdout or result.stderr) else "unknown"


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def build_library(source: str, extra_flags: tuple[str, ...] = ()) -> Path:
    """The path of a shared library built from ``source`` (from the cache when it is there)."""
    command = compiler()
    math_flags, math_libraries = _math_flags()
    flags = (*FLAGS, *math_flags, *extra_flags)
    libraries = (*LIBRARIES, *math_libraries)
    # the command itself too: a wrapper or a CC with its own flags builds different code from the same compiler
    key = _key(source, command, *flags, version(command))
    directory = cache_dir() / "kernels"
    library = directory / f"{key}.so"
    if intact(library):
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with entry_lock(library):
        if intact(library):  # another process built it while this one waited
            return library
        write_atomically(directory / f"{key}.c", source.encode())
        units = translation_units(source, os.cpu_count() or 1)
        with _temporary(directory, key, ".so") as temporary:
            if len(units) > 1:
                objects = _objects(units, command, flags, directory)
                arguments = [*shlex.split(command), *flags, *map(str, objects), "-o", temporary, *libraries]
                _check(_run(arguments), source_of=directory / f"{key}.c")
            else:
                arguments = [*shlex.split(command), *flags, "-x", "c", "-", "-o", temporary, *libraries]
                _check(_run(arguments, source), directory / f"{key}.c")
            seal(temporary, library)
    return library


#: how a sanitizer program (``executor.sanitizer_program``) is built: AddressSanitizer and UBSan, the
#: first report fatal; -march=native as the kernels are built (their vector packers run)
SANITIZER_FLAGS = (
    *("-O1", "-g", "-march=native", "-fopenmp", "-std=gnu11"),
    *("-fsanitize=address,undefined", "-fno-sanitize-recover=all"),
)


def build_sanitized(source: str) -> Path:
    """An executable of the C program ``source`` built with ``SANITIZER_FLAGS`` (cached under
    ``kernels/sanitized`` as libraries are: such a build of a large model takes a minute)."""
    command = compiler()
    key = _key(source, command, *SANITIZER_FLAGS, version(command))
    directory = cache_dir() / "kernels" / "sanitized"
    program = directory / key
    if intact(program):
        return program
    directory.mkdir(parents=True, exist_ok=True)
    with entry_lock(program):
        if not intact(program):
            write_atomically(directory / f"{key}.c", source.encode())
            # its translation units compiled at once, one process a core, as a large library's are
            objects = _objects(translation_units(source, os.cpu_count() or 1), command, SANITIZER_FLAGS, directory)
            with _temporary(directory, key, "") as temporary:
                arguments = [*shlex.split(command), *SANITIZER_FLAGS, *map(str, objects), "-o", temporary, *LIBRARIES]
                _check(_run(arguments), directory / f"{key}.c")
                os.chmod(temporary, 0o755)
                seal(temporary, program)
    return program


def translation_units(source: str, count: int) -> list[str]:
    """``source`` as up to ``count`` translation units of about equal size (one where it is small or
    has no ``UNIT`` lines): each the header, prototypes of every exported function, and its share of
    the functions, the largest first to the least filled."""
    header, *chunks = source.split(UNIT)
    if count < 2 or len(chunks) < 2 or len(source) < UNIT_BYTES:
        return [source]
    prototypes = "\n".join(f"{match.group(1)};" for chunk in chunks for match in _EXPORTED.finditer(chunk))
    bins: list[list[int]] = [[] for _ in range(min(count, len(chunks), -(-len(source) // (UNIT_BYTES // 2))))]
    sizes = [0] * len(bins)
    for k in sorted(range(len(chunks)), key=lambda k: len(chunks[k]), reverse=True):
        least = sizes.index(min(sizes))
        bins[least].append(k)
        sizes[least] += len(chunks[k])
    return [f"{header}\n{prototypes}\n" + "\n\n".join(chunks[k] for k in sorted(b)) for b in bins]


def _objects(units: list[str], command: str, flags: tuple[str, ...], directory: Path) -> list[Path]:
    """The object files of ``units``, compiled at once (one process each) where not cached."""
    objects = directory / "objects"
    objects.mkdir(exist_ok=True)
    paths = [objects / f"{_key(unit, command, *flags, version(command))}.o" for unit in units]
    running = []
    with contextlib.ExitStack() as stack:
        for unit, path in zip(units, paths, strict=True):
            if intact(path):
                continue
            temporary = stack.enter_context(_temporary(objects, path.stem, ".o"))
            process = subprocess.Popen(
                [*shlex.split(command), *flags, "-c", "-x", "c", "-", "-o", temporary],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            process.stdin.write(unit)
            process.stdin.close()
            running.append((process, temporary, path, unit))
        for process, temporary, path, unit in running:
            stderr = process.stderr.read()
            process.wait()
            process.stdout.close()
            process.stderr.close()
            if process.returncode != 0:
                failed = path.with_suffix(".c")
                failed.write_text(unit)
                _check(subprocess.CompletedProcess([], process.returncode, "", stderr), failed)
            with entry_lock(path):  # an object two libraries share may be sealed by both at once
                seal(temporary, path)
    return paths


@contextlib.contextmanager
def _temporary(directory: Path, key: str, suffix: str):
    """A temporary file's name in ``directory`` (removed afterwards unless renamed into place)."""
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=suffix)
    os.close(handle)
    try:
        yield temporary
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _run(arguments: list[str], source: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(arguments, input=source, capture_output=True, text=True, check=False)


def _check(result: subprocess.CompletedProcess, source_of: Path) -> None:
    """A ``CompileError`` with the compiler's first lines where it failed."""
    if result.returncode != 0:
        lines = [line for line in result.stderr.splitlines() if line.strip()][:ERROR_LINES]
        raise CompileError(
            f"the C compiler failed (exit {result.returncode}; source {source_of}): " + " | ".join(lines)
        )


def load_library(source: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    """Build (or fetch from the cache) and load the library of ``source``."""
    return ctypes.CDLL(str(build_library(source, extra_flags)))
