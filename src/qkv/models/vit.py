"""Vision Transformer (Dosovitskiy et al. 2021): an image as a complete graph of patches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..nn.blocks import BlockConfig, TransformerBlock
from ..nn.norms import make_norm
from ..nn.positions import Positions
from .common import check_config, init_weights


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

    image_size: int | list[int]
    patch_size: int | list[int]
    in_channels: int
    num_classes: int
    d_model: int
    n_layer: int
    n_head: int
    n_kv_head: int | None = None
    d_ff: int | None = None
    dropout: float = 0.0
    pooling: str = "cls"
    positions: str = "learned"
    norm: str = "layernorm"
    ffn: str = "gelu"
    similarity: str = "dot"
    attention: str = "softmax"
    bias: bool = True
    norm_eps: float = 1e-6

    def __post_init__(self):
        check_config(
            "ViTConfig", d_model=self.d_model, n_head=self.n_head, n_kv_head=self.n_kv_head,
            positions=self.positions, attention=self.attention,
        )
        image, patch = _pair(self.image_size, "image_size"), _pair(self.patch_size, "patch_size")
        if image[0] % patch[0] or image[1] % patch[1]:
            raise ValueError(
                f"ViTConfig: image_size {image} is not divisible by patch_size {patch}"
            )
        if self.pooling not in ("cls", "mean"):
            raise ValueError(f"ViTConfig: pooling must be 'cls' or 'mean'; got {self.pooling!r}")

    @property
    def grid(self) -> tuple[int, int]:
        """Patches along height and width."""
        (h, w) = _pair(self.image_size, "image_size")
        (ph, pw) = _pair(self.patch_size, "patch_size")
        return h // ph, w // pw

    def block(self) -> BlockConfig:
        return BlockConfig(
            d_model=self.d_model, n_head=self.n_head, d_ff=self.d_ff or 4 * self.d_model,
            n_kv_head=self.n_kv_head, dropout=self.dropout, norm=self.norm,
            norm_eps=self.norm_eps, norm_first=True, ffn=self.ffn, bias=self.bias,
            similarity=self.similarity, attention=self.attention,
        )


class ViT(nn.Module):
    """Patch embedding (a strided convolution), class token, learned positions, pre-norm
    blocks with no mask (every patch attends to every patch), final norm, linear head."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = c = config
        patch = _pair(c.patch_size, "patch_size")
        self.image_size = _pair(c.image_size, "image_size")
        self.patch_embed = nn.Conv2d(c.in_channels, c.d_model, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.d_model))
        num_tokens = c.grid[0] * c.grid[1] + 1
        self.positions = Positions(
            c.positions, d_model=c.d_model, n_head=c.n_head, head_dim=c.d_model // c.n_head,
            max_len=num_tokens,
        )
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(
            TransformerBlock(c.block(), i, self.positions.rope) for i in range(c.n_layer)
        )
        self.norm = make_norm(c.norm, c.d_model, c.norm_eps, c.bias)
        self.head = nn.Linear(c.d_model, c.num_classes)
        init_weights(self)
        nn.init.normal_(self.cls_token, 0.0, 0.02)

    def forward(self, images: Tensor) -> Tensor:
        """images (B, C, H, W) float -> logits (B, num_classes)."""
        c = self.config
        if not isinstance(images, Tensor) or images.dim() != 4 or not images.is_floating_point():
            raise ValueError("images must be a float tensor (B, C, H, W)")
        if images.shape[1] != c.in_channels or tuple(images.shape[2:]) != self.image_size:
            raise ValueError(
                f"images must have shape (B, {c.in_channels}, {self.image_size[0]}, "
                f"{self.image_size[1]}); got {tuple(images.shape)}"
            )
        patches = self.patch_embed(images).flatten(2).transpose(1, 2)  # (B, P, d_model)
        cls = self.cls_token.expand(images.shape[0], -1, -1).to(patches.dtype)
        x = torch.cat((cls, patches), dim=1)
        pos = torch.arange(x.shape[1], device=x.device)
        pe = self.positions.embed(pos)
        x = self.drop(x if pe is None else x + pe.to(x.dtype))
        score_mod = self.positions.score_mod()
        for block in self.blocks:
            x = block(x, score_mod=score_mod, positions=pos)
        x = self.norm(x)
        return self.head(x[:, 0] if c.pooling == "cls" else x[:, 1:].mean(1))
