"""Atomic file writes: temp file in the same folder, fsync, rename, fsync the folder.

A kill at any moment leaves either the old file or the new one, never a torn one. The file
gets the permissions a plain ``open(path, "w")`` would give (0644 under the usual umask), not
the temp file's private 0600.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, write: Callable[[str], None]) -> Path:
    """Call ``write(temp_path)`` and move the finished file onto ``path`` atomically."""
    path = Path(path)
    if path.is_dir():  # the rename would fail only after the work, naming the temp file
        raise IsADirectoryError(f"{path} is a directory; expected a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(temp)
        with open(temp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(temp, 0o666 & ~current_umask())
        os.replace(temp, path)
    except BaseException:
        if os.path.exists(temp):
            os.unlink(temp)
        raise
    fsync_dir(path.parent)
    return path


def current_umask() -> int:
    """The process umask (reading it means setting it, so it is put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def fsync_dir(folder: str | Path) -> None:
    """Make a rename inside ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: str | Path, data: bytes) -> Path:
    def write(temp: str) -> None:
        with open(temp, "wb") as f:
            f.write(data)

    return write_atomic(path, write)


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_bytes_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | Path, obj) -> Path:
    return write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


