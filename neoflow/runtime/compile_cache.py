"""Compiled models kept on disk: compiling the same model with the same options and the same neoflow again
loads the compiled model (its graphs, fusion plans and generated code; the kernels from the kernel cache)
instead of importing, differentiating, planning and lowering it again.

Kept under ``$NEOFLOW_CACHE_DIR/models/<key>.pickle``; the key covers the model's bytes, every compile option
and a hash of neoflow's own source, so a changed model, option or neoflow never finds a stale entry.
``NEOFLOW_COMPILE_CACHE=0`` turns it off.  Only the ``cpu`` and ``interp`` targets' models are cached (``TARGETS``);
a model whose executors cannot be pickled is compiled every time.  An entry is stored with its SHA-256 beside
it; one whose bytes no longer match is a miss.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from functools import cache
from pathlib import Path

from neoflow.targets.cache import cache_dir, entry_lock, intact, store_sealed

#: the targets whose compiled models are cached (their executors reload from what they keep)
TARGETS = ("cpu", "interp")


def enabled() -> bool:
    """Whether compiles use the cache (``NEOFLOW_COMPILE_CACHE`` unset or not ``0``)."""
    return os.environ.get("NEOFLOW_COMPILE_CACHE", "1") != "0"


@cache
def code_hash() -> str:
    """A hash of every Python source file of the neoflow package (computed once a process)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def key(*parts: bytes | str) -> str:
    """The cache key of a compile: its parts (model bytes, options) and neoflow's code hash."""
    digest = hashlib.sha256(code_hash().encode())
    for part in parts:
        data = part if isinstance(part, bytes) else part.encode()
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.hexdigest()[:40]


def _path(name: str) -> Path:
    return cache_dir() / "models" / f"{name}.pickle"


def lookup(name: str) -> object | None:
    """The compiled model stored under ``name``, or None (absent, damaged or unreadable: it is compiled
    again)."""
    path = _path(name)
    if not intact(path):
        return None
    try:
        with path.open("rb") as stream:
            return pickle.load(stream)
    except Exception:  # an entry of an incompatible environment is a miss, never an error
        return None


def store(name: str, compiled: object) -> bool:
    """Store ``compiled`` under ``name`` (with its digest, renamed into place); False where it cannot be
    pickled."""
    try:
        data = pickle.dumps(compiled, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # executors holding device state: not cached
        return False
    path = _path(name)
    with entry_lock(path):
        store_sealed(path, data)
    return True
