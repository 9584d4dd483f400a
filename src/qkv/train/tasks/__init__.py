"""The tasks the ``qkv`` command trains: one object per task, looked up by name.

A task provides: ``schema`` (its configuration keys), ``presets``, ``prepare`` (data and
tokenizers; the data's ``new_files`` are tokenizer files still to write), ``build_model``,
``loss_sum`` (summed loss of a batch), ``evaluate``, ``summary`` (one line of an evaluation)
and ``report`` (the end-of-training printout; ``heatmap``, when the caller passes
``qkv.viz.heatmap.cross_attention_png``, draws attention pictures).
"""

from .lm import LMTask
from .translate import TranslateTask
from .vit import VitTask

TASKS = {task.name: task for task in (TranslateTask(), LMTask(), VitTask())}

__all__ = ["TASKS"]
