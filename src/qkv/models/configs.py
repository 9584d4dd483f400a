"""The model configs: each holds a ``BlockConfig`` (``block``) and a ``PositionsConfig``
(``positions``) instead of restating their fields, plus what is its own.

Nested sections may be given as dicts (a config file, a run's ``model.json``): a dict fills in
over the model's default section, so ``GPTConfig(..., block={"n_head": 4})`` keeps GPT's
other block defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass, field

from ..limits import check_limits, limited
from ..nn.blocks import BlockConfig
from ..nn.positions import PositionsConfig

SECTIONS = {"block": BlockConfig, "positions": PositionsConfig}
POOLINGS = ("mean", "cls", "first")


def _compose(config, name: str) -> None:
    """Dict sections -> their dataclasses, over the field's default; then the limits."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in SECTIONS and isinstance(value, dict):
            known = {g.name for g in dataclasses.fields(SECTIONS[f.name])}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(f"{name}: {f.name} has no key {unknown[0]!r}; its keys are "
                                 f"{', '.join(sorted(known))}")
            setattr(config, f.name, dataclasses.replace(f.default_factory(), **value))
        elif f.name in SECTIONS and not isinstance(value, SECTIONS[f.name]):
            raise ValueError(f"{name}: {f.name} must be a {SECTIONS[f.name].__name__} (or a "
                             f"dict of its fields); got {type(value).__name__}")
    check_limits(config, name)


def _section(cls, **defaults):
    return field(default_factory=lambda: cls(**defaults))


def _required(interval: str):
    return limited(MISSING, interval)


@dataclass
class GPTConfig:
    """A GPT. ``block_size`` is the longest sequence (the learned position table's size and
    the longest generation). ``window``: local causal attention, each token sees itself and
    the ``window`` before it (None: all earlier tokens)."""

    vocab_size: int = _required("[1, inf)")
    block_size: int = _required("[1, inf)")
    n_layer: int = _required("[1, inf)")
    block: BlockConfig = _section(BlockConfig)
    positions: PositionsConfig = _section(PositionsConfig, kind="learned")
    tie_embeddings: bool = True
    window: int | None = limited(None, "[0, inf)")

    def __post_init__(self):
        _compose(self, "GPTConfig")


@dataclass
class EncoderConfig:
    """An encoder. pooling "mean" averages the real tokens; "cls" prepends a learned [CLS]
    vector and pools its output; "first" pools the first token's output (BERT's [CLS], which
    the tokenizer puts in the ids). ``num_classes`` 0: no head (forward returns hidden states).
    ``normalize``: ``embed`` returns unit vectors. ``type_vocab_size`` > 0 adds token-type
    (segment) embeddings and ``embed_norm`` a norm after the embeddings, as BERT has. Padding
    comes from ``lengths`` or else from ``pad_id`` (None: no padding). ``window``: local
    attention, each token sees the ``window`` tokens on either side (None: all tokens)."""

    vocab_size: int = _required("[1, inf)")
    num_classes: int = _required("[0, inf)")
    max_len: int = _required("[1, inf)")
    n_layer: int = _required("[1, inf)")
    block: BlockConfig = _section(BlockConfig, dropout=0.1)
    positions: PositionsConfig = _section(PositionsConfig, kind="learned")
    pooling: str = limited("mean", choices=POOLINGS)
    pad_id: int | None = 0
    window: int | None = limited(None, "[0, inf)")
    type_vocab_size: int = limited(0, "[0, inf)")
    embed_norm: bool = False
    normalize: bool = False

    def __post_init__(self):
        if not isinstance(self.num_classes, int) or isinstance(self.num_classes, bool):
            raise ValueError(f"EncoderConfig: num_classes must be an int >= 0 (0: no head); "
                             f"got {self.num_classes!r}")
        _compose(self, "EncoderConfig")


@dataclass
class TransformerConfig:
    """The defaults are the paper's base model: d_model 512, 8 heads, 6 + 6 layers, d_ff 2048,
    dropout 0.1, post-norm, ReLU, sinusoidal positions, embeddings scaled by √d_model and the
    output projection tied to the target embedding.

    ``final_norm`` adds a norm after each stack (None: only with norm_first, where pre-norm
    needs it; torch.nn.Transformer always has one). ``max_len`` bounds "learned" positions."""

    src_vocab_size: int = _required("[1, inf)")
    tgt_vocab_size: int = _required("[1, inf)")
    block: BlockConfig = _section(BlockConfig, d_model=512, n_head=8, d_ff=2048, dropout=0.1,
                                  norm_first=False, ffn="relu")
    positions: PositionsConfig = _section(PositionsConfig, kind="sinusoidal")
    n_encoder_layers: int = limited(6, "[1, inf)")
    n_decoder_layers: int = limited(6, "[1, inf)")
    max_len: int = limited(512, "[1, inf)")
    pad_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    share_embeddings: bool = False
    tie_output: bool = True
    scale_embeddings: bool = True
    final_norm: bool | None = None

    def __post_init__(self):
        _compose(self, "TransformerConfig")
        if self.share_embeddings and self.src_vocab_size != self.tgt_vocab_size:
            raise ValueError(
                "TransformerConfig: share_embeddings needs src_vocab_size == tgt_vocab_size; got "
                f"{self.src_vocab_size} and {self.tgt_vocab_size}"
            )


def _pair(value, name: str) -> tuple[int, int]:
    pair = (value, value) if isinstance(value, int) else tuple(value)
    if len(pair) != 2 or not all(isinstance(v, int) and v > 0 for v in pair):
        raise ValueError(f"ViTConfig: {name} must be a positive int or a pair of them; got "
                         f"{value!r}")
    return pair


@dataclass
class ViTConfig:
    """image_size and patch_size are ints or [height, width] pairs; each side of the image
    must be a multiple of the patch's. Positions are learned, one per patch plus the class
    token; pooling "cls" classifies the class token, "mean" the average patch."""

    image_size: int | list[int] = _required("[1, inf)")
    patch_size: int | list[int] = _required("[1, inf)")
    in_channels: int = _required("[1, inf)")
    num_classes: int = _required("[1, inf)")
    n_layer: int = _required("[1, inf)")
    block: BlockConfig = _section(BlockConfig, norm_eps=1e-6)
    positions: PositionsConfig = _section(PositionsConfig, kind="learned")
    pooling: str = limited("cls", choices=("cls", "mean"))

    def __post_init__(self):
        _compose(self, "ViTConfig")
        image, patch = self.image_pair, self.patch_pair
        if image[0] % patch[0] or image[1] % patch[1]:
            raise ValueError(
                f"ViTConfig: image_size {image} is not divisible by patch_size {patch}"
            )

    @property
    def image_pair(self) -> tuple[int, int]:
        return _pair(self.image_size, "image_size")

    @property
    def patch_pair(self) -> tuple[int, int]:
        return _pair(self.patch_size, "patch_size")

    @property
    def grid(self) -> tuple[int, int]:
        """Patches along height and width."""
        (h, w), (ph, pw) = self.image_pair, self.patch_pair
        return h // ph, w // pw
