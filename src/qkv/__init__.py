"""qkv: the attention mechanism and the Transformer, exact and fast, on PyTorch.

The public names of the math of attention (the masks, score modifiers and similarities) are
listed once, in ``qkv.core.__all__``, and re-exported here beside ``qkv.attention``, which
lowers a request and runs it on an engine (``qkv.engines``); the layers and models are
``qkv.nn`` and ``qkv.models``.
"""

from . import core, engines, models, nn, threads, weighting  # noqa: F401  (qkv.core, qkv.engines, ...)
from .core import *  # noqa: F403
from .core import __all__ as _core_names
from .engines.api import attention, explain

# Before qkv runs torch's unary functions on several threads (threads.choose_vml_kernels).
threads.choose_vml_kernels()

__all__ = ["attention", "explain", *_core_names]

__version__ = "0.1.0"
