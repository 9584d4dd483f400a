"""Learning-rate schedules: the multiplier of the optimizer's base rate at each step."""

from __future__ import annotations

import math

from .config import ConfigError, TrainConfig


def warmup_steps(cfg: TrainConfig) -> int:
    """``warmup_fraction`` of the steps when it is set, else ``warmup``; at most the run's
    steps, so that a short run (``train.steps=5`` under a preset's 100-step warm-up) still
    reaches its learning rate."""
    if cfg.warmup_fraction:
        return max(1, round(cfg.warmup_fraction * cfg.steps))
    return min(cfg.warmup, cfg.steps)


def learning_rate(cfg: TrainConfig, step: int, d_model: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    cosine: linear warmup to ``lr``, then a cosine to ``lr * min_lr_ratio`` at ``steps``.
    noam: the paper's ``lr * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5)`` with s = step + 1.
    constant: linear warmup to ``lr``, then flat.
    """
    s = step + 1
    warmup = warmup_steps(cfg)
    warm = max(warmup, 1)
    if cfg.schedule == "noam":
        return cfg.lr * d_model**-0.5 * min(s**-0.5, s * warm**-1.5)
    if s <= warmup:
        return cfg.lr * s / warm
    if cfg.schedule == "constant":
        return cfg.lr
    if cfg.schedule == "cosine":
        progress = min(1.0, (s - warmup) / max(1, cfg.steps - warmup))
        floor = cfg.lr * cfg.min_lr_ratio
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    raise ConfigError(f"train.schedule: expected cosine, noam or constant, got {cfg.schedule!r}")
