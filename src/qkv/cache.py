"""The user cache folder every part of qkv shares (compiled C kernels, extracted checkpoints,
the embedded corpora), and the one way a folder appears in it: whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_dir() -> Path:
    """$QKV_CACHE, else $XDG_CACHE_HOME/qkv, else ~/.cache/qkv."""
    if os.environ.get("QKV_CACHE"):
        return Path(os.environ["QKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qkv"


def publish_folder(target: Path, fill: Callable[[Path], None]) -> Path:
    """Create the folder ``target`` with ``fill(staging)``, never visibly half-written.

    ``fill`` writes into a fresh folder beside ``target``, which is then renamed onto it, so a
    reader sees the whole folder or none. When two processes fill it at once, the first rename
    wins and the other accepts that copy. The staging folder is removed whatever ``fill``
    raises.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".partial-{target.name}-", dir=target.parent))
    try:
        fill(staging)
        os.replace(staging, target)
    except OSError:
        if not target.is_dir():  # not another process's copy that came first
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
