"""Multi-head attention: W^Q, W^K, W^V and W^O around ``qkv.attention``, with a static KV cache."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..core.similarity import Similarity, get_similarity
from ..core.weighting import Weighting, as_weighting
from ..distributed.context import active as active_context_parallel
from ..engines.api import attention
from .forget_gate import forget_scores, gate_dtype
from .heads import merge_heads, split_heads
from .linear import Linear, shared_input
from .positions import RotaryEmbedding, last_positions


class KVCache:
    """Preallocated keys (B, Hkv, max_len, D) and values (B, Hkv, max_len, Dv) of one layer.

    ``append`` writes new entries at ``length`` and returns every cached entry so far; the
    queries of that step are the last Nq positions, which is exactly the bottom-right
    alignment ``qkv.causal()`` uses (query i sees keys j <= i + Nk - Nq).

    ``gate_heads`` > 0 also keeps ``gates`` (B, gate_heads, max_len): a forget gate's
    cumulative sums over the cached positions, which the layer writes (``forget_scores``)."""

    def __init__(
        self, batch: int, kv_heads: int, max_len: int, head_dim: int, value_dim: int, *,
        device=None, dtype=torch.float32, gate_heads: int = 0,
    ):
        # Only [0, length) is ever read, so the buffers need no zeros.
        self.k = torch.empty(batch, kv_heads, max_len, head_dim, device=device, dtype=dtype)
        self.v = torch.empty(batch, kv_heads, max_len, value_dim, device=device, dtype=dtype)
        self.gates = torch.empty(batch, gate_heads, max_len if gate_heads else 0,
                                 device=device, dtype=gate_dtype(dtype))
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(
                f"KV cache overflow: {end} positions but the cache holds max_len={self.max_len}"
            )
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def cached(self) -> tuple[Tensor, Tensor]:
        return self.k[:, :, : self.length], self.v[:, :, : self.length]

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (B',) in that order (beam search)."""
        self.k = self.k.index_select(0, index)
        self.v = self.v.index_select(0, index)
        self.gates = self.gates.index_select(0, index)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,
    head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V).

    Args:
        d_model: width of the queries and of the output.
        n_head: query heads H; d_k = d_v = d_model / H unless ``head_dim`` is given.
        n_kv_head: key/value heads Hkv (grouped / multi-query attention); H % Hkv == 0.
        kdim, vdim: widths of the key and value inputs (cross-attention); default d_model.
        bias: bias in the four projections.
        dropout: dropout on the attention weights, in training mode only.
        similarity, scale: passed to ``qkv.attention``: a registered similarity name or a
            ``qkv.Similarity``; "mahalanobis" adds a learnable metric L (H, d_k, d_k),
            initialized to the identity, and a user similarity's ``nn.Parameter``s join the
            module's parameters, as does a scale that is an ``nn.Parameter`` of shape () or
            (H,) (a learnable temperature: Swin V2's cosine attention).
        weighting: how scores become weights, as ``qkv.attention`` takes it: "softmax",
            "sigmoid", ... or an object from ``qkv.weighting``, whose ``nn.Parameter``s
            (a learnable sigmoid bias) join the module's parameters.
        rope: a shared RotaryEmbedding applied to q and k (self-attention only).
        is_cross: True for encoder-decoder attention (keys come from a memory, which a cache
            keeps after the first call).
        forget_gate: forgetting attention (self-attention only): a ``forget_proj``
            kdim -> H with a bias gives f = σ(forget_proj(key)) per head and key position,
            added to the scores as ``qkv.forget_gate(log f)``; a cache keeps its sums.

    Every call reaches ``qkv.attention`` through ``attend``, the layer's one call point
    (``qkv.viz.capture`` wraps it to record attention maps). The attribute
    ``fp32_precision`` ("ieee", or "bf16" to let float32 inputs be rounded to bf16 for the
    products, ``qkv.attention``'s keyword) goes with every call; ``pack_linears(model,
    torch.bfloat16)`` sets it to "bf16".
    """

    def __init__(
        self, d_model: int, n_head: int, *, n_kv_head: int | None = None,
        kdim: int | None = None, vdim: int | None = None, bias: bool = True,
        dropout: float = 0.0, similarity: str | Similarity = "dot",
        scale: float | Tensor | None = None, head_dim: int | None = None,
        rope: RotaryEmbedding | None = None,
        is_cross: bool = False, weighting: str | Weighting = "softmax",
        forget_gate: bool = False,
    ):
        super().__init__()
        n_kv_head = n_head if n_kv_head is None else n_kv_head
        if n_head <= 0 or n_kv_head <= 0:
            raise ValueError(f"n_head and n_kv_head must be positive; got {n_head}, {n_kv_head}")
        if head_dim is None and d_model % n_head:
            raise ValueError(f"d_model={d_model} must be divisible by n_head={n_head}")
        if n_head % n_kv_head:
            raise ValueError(f"n_head={n_head} must be divisible by n_kv_head={n_kv_head}")
        if rope is not None and is_cross:
            raise ValueError("rope applies to self-attention only, not to is_cross=True")
        if forget_gate and is_cross:
            raise ValueError("forget_gate applies to self-attention only, not to is_cross=True")
        self.d_model, self.n_head, self.n_kv_head = d_model, n_head, n_kv_head
        self.head_dim = head_dim or d_model // n_head
        self.kdim, self.vdim = kdim or d_model, vdim or d_model
        # A registered name or a qkv.Similarity, resolved now so that a wrong name fails here.
        resolved = get_similarity(similarity)
        self.similarity, self.scale, self.dropout = similarity, scale, dropout
        self.rope, self.is_cross = rope, is_cross
        # "bf16": float32 inputs may be rounded to bf16 for attention's products (an
        # inference speed choice; ``qkv.attention``'s fp32_precision). pack_linears sets it.
        self.fp32_precision = "ieee"
        self.q_proj = Linear(d_model, n_head * self.head_dim, bias=bias)
        self.k_proj = Linear(self.kdim, n_kv_head * self.head_dim, bias=bias)
        self.v_proj = Linear(self.vdim, n_kv_head * self.head_dim, bias=bias)
        self.out_proj = Linear(n_head * self.head_dim, d_model, bias=bias)
        self.forget_proj = Linear(self.kdim, n_head, bias=True) if forget_gate else None
        self.metric = None
        # Learnable tensors a user's similarity reads train with the module (shared by every
        # module that uses the same similarity, as the similarity itself is).
        self.similarity_params = nn.ParameterList(
            [t for t in resolved.tensors() if isinstance(t, nn.Parameter)])
        self.weighting = as_weighting(weighting)
        self.weighting_params = nn.ParameterList(
            [t for t in self.weighting.tensors() if isinstance(t, nn.Parameter)])
        if resolved.needs_metric:
            eye = torch.eye(self.head_dim).expand(n_head, -1, -1).clone()
            self.metric = nn.Parameter(eye)

    @staticmethod
    def _check_width(name: str, x: Tensor | None, width: int) -> None:
        """x (B, N, width): a wrong feature size is named here, not as a matmul's shapes."""
        if x is not None and (x.dim() != 3 or x.shape[-1] != width):
            raise ValueError(f"{name} must have shape (B, N, {width}); got {tuple(x.shape)}")

    def new_cache(self, batch: int, max_len: int, *, device=None, dtype=None) -> KVCache:
        """An empty cache for ``batch`` rows and up to ``max_len`` key positions."""
        weight = self.k_proj.weight
        # A PackedLinear keeps a bf16 weight but float32 activations; the cache holds those.
        activations = getattr(self.k_proj, "activation_dtype", weight.dtype)
        return KVCache(
            batch, self.n_kv_head, max_len, self.head_dim, self.head_dim,
            device=device or weight.device, dtype=dtype or activations,
            gate_heads=0 if self.forget_proj is None else self.n_head,
        )

    def forward(
        self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
        mask=None, score_mod=None, positions: Tensor | None = None,
        cache: KVCache | None = None, return_weights: bool = False,
    ):
        """query (B, Nq, d_model); key (B, Nk, kdim) and value (B, Nk, vdim), default: the
        query (self-attention) and the key. positions (Nk,) or (B, Nk) for rope (or their
        ``RotaryEmbedding.rotation``): the positions of the new keys, default cache.length +
        arange(Nk); the queries sit at the last Nq of them (a self-attention key longer than
        its query computes outputs for the last positions only). A cross-attention
        cache holds the projected memory after the first call, so later calls may pass
        key=None.

        Returns out (B, Nq, d_model), or (out, weights (B, H, Nq, Nk))."""
        self._check_width("query", query, self.d_model)
        self._check_width("key", key, self.kdim)
        self._check_width("value", value, self.vdim)
        if self.is_cross and cache is not None and cache.length > 0:
            q = split_heads(self.q_proj(query), self.n_head)
            k, v = cache.cached()
        else:
            if self.is_cross and key is None:
                raise ValueError("cross-attention needs key (the memory) on its first call")
            key = query if key is None else key
            value = key if value is None else value
            q, k, v = self._project(query, key, value)
            if self.rope is not None:
                if positions is None:
                    start = 0 if cache is None else cache.length
                    positions = torch.arange(start, start + k.shape[2], device=q.device)
                if q.shape[2] > k.shape[2]:
                    raise ValueError(
                        f"rope self-attention takes queries that are the last Nq of its "
                        f"keys: query has {q.shape[2]} positions, key {k.shape[2]}")
                q_positions = positions
                if q.shape[2] < k.shape[2]:
                    q_positions = last_positions(positions, q.shape[2])
                q, k = self.rope(q, q_positions), self.rope(k, positions)
            if cache is not None:
                k, v = cache.append(k, v)
            if self.forget_proj is not None:
                score_mod = forget_scores(self.forget_proj(key), cache, score_mod)
        kwargs = dict(
            mask=mask, score_mod=score_mod, similarity=self.similarity, scale=self.scale,
            metric=self.metric, return_weights=return_weights, weighting=self.weighting,
            dropout_p=self.dropout if self.training else 0.0, fp32_precision=self.fp32_precision,
        )
        split = active_context_parallel()
        if split is not None and not self.is_cross and cache is None and not return_weights:
            # One sequence split across ranks (qkv.distributed.context_parallel).
            if self.forget_proj is not None:
                raise ValueError("forget_gate sums over the whole sequence; it does not run "
                                 "under context parallelism")
            if kwargs.pop("dropout_p"):
                raise ValueError("context parallel attention has no attention dropout (it "
                                 "would need whole rows); set the model's dropout to 0")
            kwargs.pop("return_weights")
            kwargs.pop("fp32_precision")  # each rank's engines keep float32 products
            out, weights = split.attention(q, k, v, **kwargs), None
        else:
            out, weights = self.attend(q, k, v, **kwargs)
        out = self.out_proj(merge_heads(out))
        return (out, weights) if return_weights else out

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, ...]:
        """q (B, H, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv) from their projections, in
        one few-row call where they share an input (``qkv.nn.linear.shared_input``)."""
        if key is query and value is key:
            q, k, v = shared_input(query, (self.q_proj, self.k_proj, self.v_proj))
        else:
            q = self.q_proj(query)
            k, v = (shared_input(key, (self.k_proj, self.v_proj)) if value is key
                    else (self.k_proj(key), self.v_proj(value)))
        return (split_heads(q, self.n_head), split_heads(k, self.n_kv_head),
                split_heads(v, self.n_kv_head))

    @property
    def observed(self) -> bool:
        """Whether something wraps this layer's ``attend`` (``qkv.viz.capture``), so that every
        query's weights are wanted: a block then keeps all its queries (``last``)."""
        return getattr(self.attend, "__func__", None) is not type(self).attend

    def attend(self, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> tuple[Tensor, Tensor | None]:
        """The layer's one call to ``qkv.attention``: q (B, H, Nq, D), k (B, Hkv, Nk, D) and
        v (B, Hkv, Nk, Dv) as the engine sees them (after RoPE and the KV cache), with
        attention's keywords. Returns out (B, H, Nq, Dv) and the weights (B, H, Nq, Nk) when
        ``return_weights``, else None."""
        result = attention(q, k, v, **kwargs)
        return result if kwargs["return_weights"] else (result, None)

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> MultiHeadAttention:
        """Copy a ``torch.nn.MultiheadAttention`` (batch_first or not; the result always takes
        (B, N, E) inputs). add_bias_kv and add_zero_attn have no counterpart and are refused."""
        if not isinstance(m, nn.MultiheadAttention):
            raise TypeError(
                f"from_torch expects torch.nn.MultiheadAttention; got {type(m).__name__}"
            )
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch: add_bias_kv and add_zero_attn are not supported")
        bias = m.in_proj_bias is not None
        new = cls(
            m.embed_dim, m.num_heads, kdim=m.kdim, vdim=m.vdim, bias=bias, dropout=m.dropout
        ).to(device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype)
        if m._qkv_same_embed_dim:
            wq, wk, wv = m.in_proj_weight.chunk(3)
        else:
            wq, wk, wv = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
        with torch.no_grad():
            for proj, w in ((new.q_proj, wq), (new.k_proj, wk), (new.v_proj, wv)):
                proj.weight.copy_(w)
            new.out_proj.weight.copy_(m.out_proj.weight)
            if bias:
                for proj, b in zip((new.q_proj, new.k_proj, new.v_proj), m.in_proj_bias.chunk(3),
                                   strict=True):
                    proj.bias.copy_(b)
                new.out_proj.bias.copy_(m.out_proj.bias)
        return new
