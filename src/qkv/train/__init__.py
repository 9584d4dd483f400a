"""Training: configuration, the loop, checkpoints, distributed setup and the three tasks."""

from .checkpoint import CheckpointError
from .config import ConfigError, RunConfig, TrainConfig
from .result import RunResult
from .run import RunRequest, configure, load, train
from .rundir import RunError, read_run_config
from .tasks import TASKS

__all__ = [
    "TASKS", "CheckpointError", "ConfigError", "RunConfig", "RunError", "RunRequest",
    "RunResult", "TrainConfig", "configure", "load", "read_run_config", "train",
]
