"""Training: configuration, the loop, checkpoints, distributed setup and the three tasks."""

from .checkpoint import CheckpointError
from .config import ConfigError, RunConfig, TrainConfig
from .run import RunError, load, read_run_config, start
from .tasks import TASKS

__all__ = [
    "TASKS", "CheckpointError", "ConfigError", "RunConfig", "RunError", "TrainConfig", "load",
    "read_run_config", "start",
]
