"""Where every target keeps what it compiled (libraries, cubins, machine figures) and what it
measured (``neoflow tune``'s tables of results)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def cache_dir() -> Path:
    """Where compiled kernels are kept (``NEOFLOW_CACHE_DIR`` or ``~/.cache/neoflow``)."""
    root = os.environ.get("NEOFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "neoflow")
    return Path(root)


@contextmanager
def _written(path: Path, data: bytes) -> Iterator[str]:
    """A temporary file beside ``path`` holding ``data`` (the permissions the umask gives a new file),
    removed afterwards unless the caller renamed it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(temporary, 0o666 & ~umask)
        yield temporary
    finally:
        Path(temporary).unlink(missing_ok=True)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place, so a reader
    (another process sharing the cache) never sees half a file."""
    with _written(path, data) as temporary:
        os.replace(temporary, path)


#: the suffix of the file beside each cache entry holding the SHA-256 of its bytes
DIGEST_SUFFIX = ".sha256"


def file_digest(path: Path | str) -> str:
    """The SHA-256 of the file at ``path``, in hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def seal(temporary: Path | str, path: Path) -> None:
    """Put a finished build (the complete file ``temporary``, in ``path``'s directory) into the
    cache at ``path``: first its digest beside it, then the file renamed into place.  Called under
    ``entry_lock(path)``, so the file in place always has the digest it was written with."""
    write_atomically(_digest_path(path), file_digest(temporary).encode())
    os.replace(temporary, path)


def store_sealed(path: Path, data: bytes) -> None:
    """Write ``data`` into the cache at ``path`` as ``seal`` does (under ``entry_lock(path)``)."""
    with _written(path, data) as temporary:
        seal(temporary, path)


def intact(path: Path) -> bool:
    """Whether the cache entry at ``path`` is there and whole: its bytes match the digest written
    with it (a truncated, corrupted or digest-less entry is not, and is built again)."""
    try:
        expected = _digest_path(path).read_text().strip()
        return file_digest(path) == expected
    except OSError:
        return False


@contextmanager
def entry_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the cache entry ``path`` (one of 256 lock files of its directory,
    by the entry's name): processes building the same entry at once take turns, and the one that
    comes second finds it built."""
    locks = path.parent / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    stripe = hashlib.sha256(path.name.encode()).hexdigest()[:2]
    with open(locks / stripe, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def tuning_enabled() -> bool:
    """Whether compiles use the measured tuning tables (``NEOFLOW_TUNING`` unset or not ``0``)."""
    return os.environ.get("NEOFLOW_TUNING", "1") != "0"


_tables: dict[Path, tuple[tuple[int, int], dict, str]] = {}


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_mtime_ns, status.st_size


def _load(path: Path) -> tuple[dict, str]:
    """The table at ``path`` and a hash of its bytes, read again only when the file changed."""
    stamp = _stamp(path)
    if stamp is None:
        return {}, "none"
    cached = _tables.get(path)
    if cached is not None and cached[0] == stamp:
        return cached[1], cached[2]
    try:
        data = path.read_bytes()
        entries = json.loads(data)
    except (OSError, ValueError):
        data, entries = b"", {}
    if not isinstance(entries, dict):
        entries = {}
    digest = hashlib.sha256(data).hexdigest()[:16]
    _tables[path] = (stamp, entries, digest)
    return entries, digest


def read_table(path: Path) -> dict[str, dict]:
    """The JSON object of results at ``path`` (empty where there is none or it is damaged: measuring
    again rewrites it)."""
    return _load(path)[0]


def update_table(path: Path, entries: dict[str, dict]) -> None:
    """Add ``entries`` to the table at ``path``, written atomically; read again under a lock just
    before, so that the entries other processes add at the same time are all kept."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(f".{path.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _tables.pop(path, None)
        merged = {**read_table(path), **entries}
        write_atomically(path, json.dumps(merged, indent=1, sort_keys=True).encode())
    _tables.pop(path, None)


def table_digest(path: Path) -> str:
    """A hash of the table at ``path`` as compiles would read it now (``off`` where tuning is ignored,
    ``none`` where there is no table); cheap while the file is unchanged."""
    if not tuning_enabled():
        return "off"
    return _load(path)[1]


def within_budget(items: Sequence[T], deadline: float, progress: Callable[[int, int, str], None] | None) -> Iterator[T]:
    """``items`` (ops to tune, by ``name``) one by one until ``time.perf_counter()`` passes
    ``deadline``, telling ``progress(done, total, name)`` before each."""
    for done, item in enumerate(items):
        if time.perf_counter() > deadline:
            return
        if progress is not None:
            progress(done, len(items), item.name)
        yield item
