import math

import pytest

from qkv.train.config import TrainConfig
from qkv.train.schedule import learning_rate, warmup_steps


def test_noam_is_the_papers_formula():
    cfg = TrainConfig(schedule="noam", lr=1.0, warmup=4000, steps=100_000)
    for step in (0, 100, 3999, 4000, 50_000):
        s = step + 1
        assert learning_rate(cfg, step, 512) == pytest.approx(
            512**-0.5 * min(s**-0.5, s * 4000**-1.5))
    peak = max(range(8000), key=lambda s: learning_rate(cfg, s, 512))
    assert peak == 3999


def test_cosine_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(schedule="cosine", lr=1e-3, warmup=10, steps=110, min_lr_ratio=0.1)
    assert learning_rate(cfg, 0, 64) == pytest.approx(1e-4)
    assert learning_rate(cfg, 9, 64) == pytest.approx(1e-3)
    halfway = 1e-4 + 9e-4 * 0.5 * (1 + math.cos(math.pi / 2))
    assert learning_rate(cfg, 59, 64) == pytest.approx(halfway)
    assert learning_rate(cfg, 109, 64) == pytest.approx(1e-4)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="train.schedule"):
        learning_rate(TrainConfig(schedule="step", warmup=0), 5, 64)


def test_a_warm_up_longer_than_the_run_is_cut_to_it():
    cfg = TrainConfig(schedule="cosine", lr=1e-3, warmup=100, steps=5)
    assert warmup_steps(cfg) == 5
    assert learning_rate(cfg, 0, 64) == pytest.approx(2e-4)
    assert learning_rate(cfg, 4, 64) == pytest.approx(1e-3)  # the run reaches train.lr
    assert warmup_steps(TrainConfig(warmup=100, steps=500)) == 100
