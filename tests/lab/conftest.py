"""What the lab's tests share: a lab run to its end, in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from qkv import cli


def finished_lab(tmp_path_factory, text: str) -> Path:
    """The output folder of the lab file ``text`` run to its end (one job, one thread, quiet),
    with the run's kernel cache under pytest's temporary folder; the file is its sibling
    ``lab.toml``."""
    root = tmp_path_factory.mktemp("lab")
    (root / "lab.toml").write_text(text)
    mp = pytest.MonkeyPatch()
    mp.setenv("QKV_CACHE", str(tmp_path_factory.getbasetemp() / "qkv-cache"))
    try:
        assert cli.main(["lab", str(root / "lab.toml"), "-o", str(root / "out"), "--jobs", "1",
                         "--threads", "1", "--quiet"]) == 0
    finally:
        mp.undo()
    return root / "out"
