"""The user cache folder every part of qkv shares (compiled C kernels, extracted checkpoints,
the embedded corpora)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """$QKV_CACHE, else $XDG_CACHE_HOME/qkv, else ~/.cache/qkv."""
    if os.environ.get("QKV_CACHE"):
        return Path(os.environ["QKV_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qkv"
