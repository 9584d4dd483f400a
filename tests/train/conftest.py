"""Shared helpers for the training tests: a private cache folder and tiny runs."""

import json

import pytest


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Keep the docstrings cache out of the user's home (subprocesses inherit it)."""
    monkeypatch.setenv("QKV_CACHE", str(tmp_path_factory.getbasetemp() / "qkv-cache"))


def losses(run_dir) -> list[tuple[int, float, float]]:
    """(step, loss, lr) of every training record in RUN/metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"], r["lr"]) for r in records if "loss" in r]


def tiny_lm(run_dir, steps: int, *extra: str) -> list[str]:
    return [
        "train", "lm", "--preset", "tiny", "--run-dir", str(run_dir), "--quiet",
        "--set", f"train.steps={steps}", "--set", "train.threads=1", *extra,
    ]
