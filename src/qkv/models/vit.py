"""Vision Transformer (Dosovitskiy et al. 2021): an image as a complete graph of patches."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.blocks import norm_layer, transformer_block
from ..nn.hooks import HookedModel
from ..nn.linear import Linear
from ..nn.positions import make_positions
from .common import init_weights
from .configs import ViTConfig


class ViT(HookedModel, nn.Module):
    """Patch embedding (a strided convolution), class token, learned positions, pre-norm
    blocks with no mask (every patch attends to every patch), final norm, linear head."""

    def __init__(self, config: ViTConfig):
        super().__init__()
        self.config = c = config
        b, patch = c.block, c.patch_pair
        self.image_size = c.image_pair
        self.patch_embed = nn.Conv2d(c.in_channels, b.d_model, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, b.d_model))
        num_tokens = c.grid[0] * c.grid[1] + 1
        self.positions = make_positions(
            c.positions, d_model=b.d_model, n_head=b.n_head, head_dim=b.head_dim,
            max_len=num_tokens,
        )
        self.drop = nn.Dropout(b.dropout)
        self.blocks = nn.ModuleList(
            transformer_block(b, self.positions.rotary(), num_tokens, depth=i)
            for i in range(c.n_layer)
        )
        self.norm = norm_layer(b)
        self.head = Linear(b.d_model, c.num_classes)
        self.pool_class_token = c.pooling == "cls"  # else the mean of the patches
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
        layer_positions = self.positions.for_layers(pos)
        for block in self.blocks:
            x = block(x, score_mod=score_mod, positions=layer_positions)
        x = self.norm(x)
        return self.head(x[:, 0] if self.pool_class_token else x[:, 1:].mean(1))
