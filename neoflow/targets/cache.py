"""Where every target keeps what it compiled (libraries, cubins, machine figures)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def cache_dir() -> Path:
    """Where compiled kernels are kept (``NEOFLOW_CACHE_DIR`` or ``~/.cache/neoflow``)."""
    root = os.environ.get("NEOFLOW_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "neoflow")
    return Path(root)


def write_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file renamed into place, so a reader
    (another process sharing the cache) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
