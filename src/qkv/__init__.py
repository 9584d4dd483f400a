"""qkv: the attention mechanism and the Transformer, exact and fast, on PyTorch.

The public names of the functional core (``qkv.attention``, the masks, score modifiers and
similarities) are listed once, in ``qkv.core.__all__``, and re-exported here; the layers and
models are ``qkv.nn`` and ``qkv.models``.
"""

from . import core, models, nn  # noqa: F401  (qkv.core, qkv.models, qkv.nn)
from .core import *  # noqa: F403
from .core import __all__ as __all__

__version__ = "0.1.0"
