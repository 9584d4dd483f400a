"""Interventions on qkv models through their TransformerLens-named hooks
(``qkv.nn.hooks``): head ablation, activation patching, attention × gradient attribution and
the logit lens."""

from .interventions import ablate, attribution, logit_lens, patch

__all__ = ["ablate", "attribution", "logit_lens", "patch"]
