"""What every engine's plan returns."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor


class Result(NamedTuple):
    """out (B, H, Nq, Dv) in q's dtype; lse (B, H, Nq), the natural log-sum-exp of each
    softmax row in the accumulation dtype (-inf on rows with no allowed key), differentiable,
    or None from an engine that has none (SDPA, which then never gets ``needs_lse``);
    weights (B, H, Nq, Nk) when the request asked for them. A named tuple: every call
    returns one, and it is cheaper to build than a frozen dataclass."""

    out: Tensor
    lse: Tensor | None = None
    weights: Tensor | None = None
