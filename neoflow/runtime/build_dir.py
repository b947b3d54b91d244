"""Build directories written atomically and read back verified.

A save stages every file in ``<dir>/.saving-*`` and writes the manifest last, listing each file with its
size and SHA-256; renaming the staging directory to ``<dir>/.next`` is the commit point.  The files then
move into ``<dir>`` one by one, the manifest last, and ``.next`` is removed.  A save interrupted before the
commit point leaves the previous save as it was (the next save clears the staging directory); one
interrupted after it is completed by the next save, and read meanwhile from ``.next`` and ``<dir>``
together.  Reading checks every listed file against the manifest and names the first that differs.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from neoflow.errors import InputError
from neoflow.targets.cache import file_digest

MANIFEST = "manifest.json"
#: the staged save that passed its commit point, while its files move into the directory
PENDING = ".next"
_STAGING = ".saving-"


def save_build(directory: Path, write_files: Callable[[Path], dict]) -> None:
    """Save a build into ``directory``: ``write_files(staging)`` writes the files into the empty
    folder ``staging`` and returns the manifest (without its ``files`` entry, which this adds)."""
    if directory.exists() and not directory.is_dir():
        raise InputError(f"'{directory}' exists and is not a directory")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _save_locked(directory, write_files)
    except OSError as err:
        raise InputError(f"cannot save the build into '{directory}': {err.strerror or err}") from None


def _save_locked(directory: Path, write_files: Callable[[Path], dict]) -> None:
    """``save_build``'s work, under the directory's lock."""
    with _locked(directory):
        _complete_pending(directory)
        for stale in directory.glob(f"{_STAGING}*"):  # saves interrupted before their commit point
            shutil.rmtree(stale, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(dir=directory, prefix=_STAGING))
        try:
            manifest = write_files(staging)
            manifest["files"] = {
                path.name: {"bytes": path.stat().st_size, "sha256": file_digest(path)}
                for path in sorted(staging.iterdir())
            }
            (staging / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            for path in staging.iterdir():
                _sync(path)
            _sync(staging)
            os.rename(staging, directory / PENDING)  # the commit point
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        _sync(directory)
        _complete_pending(directory)


def _complete_pending(directory: Path) -> None:
    """Move a committed save's files from ``.next`` into ``directory``, the manifest last, then remove
    the files only the replaced save listed."""
    pending = directory / PENDING
    if not (pending / MANIFEST).is_file():
        shutil.rmtree(pending, ignore_errors=True)  # its manifest had moved: nothing of it is left to move
        return
    replaced = set(_listed(directory / MANIFEST))
    listed = _listed(pending / MANIFEST)
    for name in listed:
        if (pending / name).exists():
            os.replace(pending / name, directory / name)
    os.replace(pending / MANIFEST, directory / MANIFEST)
    _sync(directory)
    for name in replaced - set(listed) - {MANIFEST}:
        (directory / name).unlink(missing_ok=True)
    shutil.rmtree(pending, ignore_errors=True)


def _listed(manifest: Path) -> list[str]:
    """The file names ``manifest`` lists (none where it is missing or unreadable)."""
    try:
        files = json.loads(manifest.read_text()).get("files", {})
    except (OSError, ValueError, AttributeError):
        return []
    return [name for name in files if _file_name(name)]


def _file_name(name: object) -> bool:
    """Whether ``name`` may name a file of a build: a plain name in the directory, not a hidden one."""
    return isinstance(name, str) and "/" not in name and not name.startswith(".")


@dataclass(frozen=True)
class Build:
    """A build directory's manifest and where each of its files is."""

    directory: Path
    manifest: dict
    locations: dict[str, Path]

    def path(self, name: str) -> Path:
        """Where the build's file ``name`` is (verified when the build was opened)."""
        return self.locations.get(name, self.directory / name)

    def has(self, name: str) -> bool:
        """Whether the build holds ``name``."""
        return self.path(name).is_file()


def open_build(directory: Path) -> Build:
    """The build saved in ``directory``, every file its manifest lists checked against its size and
    SHA-256 (an ``InputError`` naming the first missing or damaged file)."""
    pending = directory / PENDING
    manifest_path = pending / MANIFEST if (pending / MANIFEST).is_file() else directory / MANIFEST
    if not manifest_path.is_file():
        raise InputError(
            f"'{directory}' is not a neoflow build directory (no {MANIFEST}; make one with neoflow compile)"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        if not isinstance(manifest, dict):
            raise ValueError("not a JSON object")
        files = manifest.get("files", {})
        if not isinstance(files, dict):
            raise ValueError("'files' is not an object")
    except (OSError, ValueError) as err:
        raise InputError(f"'{manifest_path}' is not a valid neoflow manifest ({err})") from None
    locations = {MANIFEST: manifest_path}
    for name, recorded in files.items():
        if not _file_name(name) or not isinstance(recorded, dict):
            raise InputError(f"'{manifest_path}' is not a valid neoflow manifest (its entry {name!r})")
        location = pending / name if (pending / name).is_file() else directory / name
        if not location.is_file():
            raise InputError(f"'{location}' is missing from the build (its manifest lists it); save the model again")
        size = location.stat().st_size
        if size != recorded.get("bytes") or file_digest(location) != recorded.get("sha256"):
            raise InputError(
                f"'{location}' is damaged: its {size} bytes do not match the manifest's size and SHA-256 "
                f"({recorded.get('bytes')} bytes); save the model again"
            )
        locations[name] = location
    return Build(directory, manifest, locations)


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive lock on the build directory itself (saves into one directory take turns)."""
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)


def _sync(path: Path) -> None:
    """Flush ``path`` (a file or a directory) to disk, so a rename after it never exposes an empty file."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
