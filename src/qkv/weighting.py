"""``qkv.weighting``: how scores become weights (the definitions live in
``qkv.core.weighting``, beside the masks, modifiers and similarities)."""

from .core.weighting import *  # noqa: F403
from .core.weighting import (  # noqa: F401  (the classes, for isinstance and subclassing)
    Elementwise,
    Identity,
    Normalized,
    Relu,
    Sigmoid,
    Softmax,
    Softpick,
    StickBreaking,
    UserElementwise,
    __all__,
)
