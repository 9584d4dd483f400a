"""A damaged checkpoint file: the cache re-unpacks its copy, a user's directory gets one line
naming the file (as `qkv embed --model ...` is run)."""

import os
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # loads MiniLM in subprocesses


def embed(model: str, cache) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qkv.cli", "embed", "--model", model, "a", "b"],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, QKV_CACHE=str(cache), OMP_NUM_THREADS="1"))


def truncate(path, size: int = 1_000_000) -> None:
    data = path.read_bytes()[:size]
    path.write_bytes(data)


def test_a_truncated_cache_file_is_unpacked_again_and_a_user_directory_named(tmp_path):
    cache = tmp_path / "cache"
    first = embed("minilm", cache)
    assert first.returncode == 0 and first.stderr == "", first.stderr
    (unpacked,) = (cache / "checkpoints").glob("model-*")
    weights = unpacked / "model.safetensors"
    size = weights.stat().st_size
    user_dir = tmp_path / "my-model"
    shutil.copytree(unpacked, user_dir)

    truncate(weights)
    again = embed("minilm", cache)
    assert again.returncode == 0 and again.stdout == first.stdout
    assert again.stderr == (f"qkv: the cached checkpoint {unpacked} was damaged "
                            f"(model.safetensors has 1000000 bytes, not {size}); unpacking "
                            "model.zip again\n")
    assert weights.stat().st_size == size
    assert embed("minilm", cache).stderr == ""  # repaired: nothing more to say

    truncate(user_dir / "model.safetensors")
    damaged = embed(str(user_dir), cache)
    assert damaged.returncode == 2 and damaged.stderr.count("\n") == 1
    assert damaged.stderr.startswith(
        f"qkv: error: {user_dir / 'model.safetensors'} is damaged or truncated ("), damaged.stderr
