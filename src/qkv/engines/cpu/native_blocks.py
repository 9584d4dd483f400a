"""The fused engine's query blocks in C, head by head (``cpu_blocks.c``): one call per query
block runs every head over every key span, products by the BLAS that torch links.

Why: the tile path multiplies all heads of a tile at once, so each operation streams the
tile's scores (8 heads x 256 x 256 floats: 2 MiB) through L3, and a tile takes a dozen
Python-level calls that the two workers share one GIL for. Head by head, a tile's scores
(256 KiB) stay in the core's L2 between the products and the softmax pass: at N=4096 the
forward takes 0.80x and the backward 0.65-0.74x the tile path's time (docs/performance.md,
"CPU: fused engine vs SDPA").

What runs here: the matrix-product terms (dot and cosine: ``similarity.DOT`` on the
features; L2 and Mahalanobis: ``NEG_SQDIST`` as a product of lifted features) with any
mask, a number scale, no dropout, and a score modifier whose C loops (``kernelgen.c_mod``)
give its gradient without tensors of its own (ALiBi with fixed slopes, softcap, a bias
that needs no gradient). ``why_not`` names what rules a call out; the engine then runs its
tile path. The math is the tile path's, the same C softmax steps included; only the order
of the products' sums differs.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from ..lowering import TermKind, WeightsKind, term_kind, weights_kind
from . import native
from .tiles import TileSpec, tile_index, tile_mask

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_STRIDES = ctypes.c_int64 * 3


class _Call(ctypes.Structure):
    """``struct qkv_blocks`` of cpu_blocks.c: one call's shapes, tensors and strides."""

    _fields_ = [("gemm", _PTR), ("batch", _I64), ("heads", _I64), ("kv_heads", _I64),
                ("nq", _I64), ("nk", _I64), ("d", _I64), ("dv", _I64),
                ("term", _I64), ("sd", _I64), ("term_scores", _PTR), ("term_grads", _PTR),
                ("term_slots", _PTR * 4), ("term_sums", _PTR * 4), ("term_scale", ctypes.c_double),
                ("sq", _PTR), ("sk", _PTR), ("sq_st", _STRIDES), ("sk_st", _STRIDES),
                ("scale", ctypes.c_double), ("grad_scale", ctypes.c_double),
                ("mod_scores", _PTR), ("mod_scores_ds", _PTR), ("mod_slots", _PTR * 4),
                ("mod_scale", ctypes.c_double), ("offset", _I64),
                ("q", _PTR), ("k", _PTR), ("v", _PTR),
                ("q_st", _STRIDES), ("k_st", _STRIDES), ("v_st", _STRIDES),
                ("out", _PTR), ("lse", _PTR), ("out_st", _STRIDES),
                ("dout", _PTR), ("delta", _PTR), ("dout_st", _STRIDES),
                ("dq", _PTR), ("dq_st", _STRIDES), ("weights", _I64),
                ("weights_eps", ctypes.c_double), ("weights_self", _I64)]


_GEMM_NAMES = {torch.float32: "sgemm_", torch.float64: "dgemm_"}


@functools.cache
def _gemm(dtype: torch.dtype) -> int | None:
    """The address of the BLAS product torch links for ``dtype`` (MKL's or OpenBLAS's
    Fortran ``sgemm_``/``dgemm_``), or None where torch's library does not export it."""
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            function = getattr(ctypes.CDLL(os.path.join(lib_dir, name)), _GEMM_NAMES[dtype])
        except (OSError, AttributeError):
            continue
        return native.address_of(function)
    return None


def why_not(spec: TileSpec, q: Tensor, extras: Sequence[Tensor] = ()) -> str | None:
    """What keeps a call on queries (or their features) ``q`` off the C blocks (None: they
    run it)."""
    if not native.available(q.dtype) or q.dtype not in _GEMM_NAMES:
        return f"no C blocks for {q.dtype}"
    if weights_kind(spec.variant) is None:
        return (f"the C blocks have no loops for the weighting {spec.variant.normalizer!r}: "
                f"it runs on tiles")
    reason = _term_why_not(spec, q)
    if reason is not None:
        return reason
    if isinstance(spec.scale, Tensor):
        return "a tensor scale"
    mod = spec.mod_loops
    if spec.score_mod is not None and (mod is None or not (mod.grads_are_scale or
                                                           mod.keeps_slope)):
        return "a score modifier without C loops for its gradient"
    if spec.dropout_p > 0:
        return "dropout"
    if extras:
        return "gradients for tensors besides q, k and v"
    if _gemm(q.dtype) is None:
        return "torch's library exports no BLAS product to call"
    return None


def _term_why_not(spec: TileSpec, q: Tensor) -> str | None:
    kind = term_kind(spec.pair)
    if kind.products:
        if spec.pair.lift is not None and not spec.scores_lifted:
            return f"{spec.pair.name!r} without its lifted features"
        return None
    if spec.loops is None:
        return f"the term {spec.pair.name!r} has no C loops"
    if spec.loops.c_term is None:  # L1's own loops: the gradient's take whole vectors of d
        if kind is not TermKind.L1:
            return f"the term {spec.pair.name!r} has no C loops the blocks can call"
        lanes = native._load()["vector_bytes"] // q.element_size()
        if q.shape[-1] % lanes:
            return f"L1 with a head dim that is not a multiple of {lanes}"
    return None


def _rows_in_place(t: Tensor, dense: bool = False) -> Tensor:
    """t, or a contiguous copy where BLAS cannot read its rows in place (with ``dense``,
    where they are not d apart, as a term's C loops read them)."""
    rows_ok = t.stride(-2) == t.shape[-1] if dense else t.stride(-2) >= t.shape[-1]
    return t if t.stride(-1) == 1 and rows_ok else t.contiguous()


def _check_written(name: str, t: Tensor, dense: bool = False) -> None:
    """The C blocks write ``t`` in place, so it cannot be copied into the layout they need
    (``_rows_in_place``)."""
    if _rows_in_place(t, dense) is not t:
        raise ValueError(f"the C blocks write {name} in place and need rows of unit column "
                         f"stride{', d apart' if dense else ''}; got strides {tuple(t.stride())}")


def _strides(t: Tensor) -> _STRIDES:
    return _STRIDES(*t.stride()[:3])


def _call(spec: TileSpec, q: Tensor, k: Tensor, v: Tensor,
          scores: tuple[Tensor, Tensor] | None) -> tuple[_Call, list]:
    """The fields every call shares, and what it reads (to keep alive)."""
    kind = term_kind(spec.pair)
    q, k = (_rows_in_place(t, dense=not kind.products) for t in (q, k))
    v = _rows_in_place(v)
    if scores is None or not kind.products:  # the loops score the term's own features
        sq, sk = q, k
    else:
        sq, sk = (_rows_in_place(t) for t in scores)
    scale = 1.0 if spec.scale is None else float(spec.scale)
    call = _Call(gemm=_gemm(q.dtype), batch=spec.batch, heads=spec.heads, kv_heads=k.shape[1],
                 nq=spec.nq, nk=spec.nk, d=q.shape[-1], dv=v.shape[-1], term=kind,
                 sd=sq.shape[-1], sq=sq.data_ptr(), sk=sk.data_ptr(), sq_st=_strides(sq),
                 sk_st=_strides(sk), scale=scale, grad_scale=scale, q=q.data_ptr(),
                 k=k.data_ptr(), v=v.data_ptr(), q_st=_strides(q), k_st=_strides(k),
                 v_st=_strides(v), offset=spec.offset, weights=weights_kind(spec.variant),
                 weights_eps=getattr(spec.variant.normalizer, "eps", 0.0),
                 weights_self=int(getattr(spec.variant.normalizer, "include_self", False)))
    alive = [q, k, v, sq, sk]
    if not kind.products:
        alive.append(_add_loops(call, spec, q.dtype))
    return call, alive


def _add_loops(call: _Call, spec: TileSpec, dtype: torch.dtype):
    """Give ``call`` the term's C loops: generated ones (``TileLoops.c_term``) or L1's own
    under their signature; returns what their pointers point to."""
    sink = torch.zeros(1, dtype=torch.float64)  # gradient sums the loops keep for no tensor
    call.term_sums = (_PTR * 4)(*[sink.data_ptr()] * 4)
    if spec.loops.c_term is None:  # L1's: they read no tensor
        functions = native._load()
        address = (native.address_of(functions[name, dtype])
                   for name in ("l1_term_scores", "l1_term_grads"))
        call.term_scores, call.term_grads = address
        call.term_scale = 1.0
        return sink
    call.term_scores, call.term_grads, slots, call.term_scale, memory = spec.loops.c_term
    call.term_slots = (_PTR * 4)(*slots)
    return sink, memory


def _add_modifier(call: _Call, spec: TileSpec, backward: bool) -> bool:
    """Give ``call`` the score modifier's C loops, which apply the scale themselves;
    returns whether the backward keeps their slope (a third tile of scratch)."""
    scores, scores_ds, slots = spec.mod_loops.addresses()
    call.scale, call.mod_scale, call.offset = 1.0, spec.mod_scale, spec.offset
    call.mod_scores, call.mod_slots = scores, (_PTR * 4)(*slots)
    keeps_slope = backward and spec.mod_loops.keeps_slope
    if keeps_slope:  # the slope and scale go into the softmax's gradient
        call.mod_scores_ds, call.grad_scale = scores_ds, 1.0
    else:  # d mod / d score = 1: only the scale
        call.grad_scale = spec.mod_scale
    return keeps_slope


class Blocks:
    """One call's C blocks, forward (``out`` and ``lse`` given) or backward (``dout``,
    ``lse`` with +inf on rows that allow no key, ``delta`` and ``dq`` given): ``run(i,
    spans, scratch[, dk, dv_t])`` computes query block i over its key spans. q and k are
    the term's features; ``scores`` the features its scores multiply (``score_features``),
    when they differ."""

    def __init__(self, spec: TileSpec, q: Tensor, k: Tensor, v: Tensor, *, scores=None,
                 out=None, lse: Tensor, dout=None, delta=None, dq=None):
        self.spec = spec
        self.call, self._alive = _call(spec, q, k, v, scores)
        keeps_slope = spec.mod_loops is not None and _add_modifier(self.call, spec, out is None)
        if out is not None:  # out and lse are written: the caller's own, never a copy
            _check_written("out", out)
            if not lse.is_contiguous():
                raise ValueError("the C blocks write lse in place and need it contiguous")
            self.call.out, self.call.out_st = out.data_ptr(), _strides(out)
            self._function = native._load()["block_forward", q.dtype]
        else:  # dq is written (rows d apart for a term's C loops); the rest is read
            _check_written("dq", dq, dense=not TermKind(self.call.term).products)
            lse, dout, delta = lse.contiguous(), _rows_in_place(dout), delta.contiguous()
            self._alive += [lse, dout, delta]
            self.call.dout, self.call.dout_st = dout.data_ptr(), _strides(dout)
            self.call.delta = delta.data_ptr()
            self.call.dq, self.call.dq_st = dq.data_ptr(), _strides(dq)
            self._function = native._load()["block_backward", q.dtype]
        self.call.lse = lse.data_ptr()
        # Per block (cpu_blocks.c): forward, a tile of scores, the output's sums, row max and
        # row sum; backward, tiles of scores and dp (and the slope), and a row of key sums;
        # both, the C loops' transposed block of keys. Softpick and the stick keep their
        # backward's weights apart from the scores, and the stick two row sums and two rows
        # of its shares.
        rows, widest = spec.block_q, max(spec.span_k, spec.block_k)
        apart = self.call.weights in (WeightsKind.SOFTPICK, WeightsKind.STICK)
        self._scratch = (rows * (widest + v.shape[-1] + 2) + widest if out is not None else
                         rows * widest * (3 if keeps_slope else 2) + widest
                         + ((rows + 2) * widest + 2 * rows if apart else 0)
                         ) + native._BLOCK * self.call.sd

    def scratch(self, like: Tensor) -> Tensor:
        """One worker's buffer for any block of this call."""
        return like.new_empty(self._scratch)

    def run(self, i: int, spans, scratch: Tensor, *sums: Tensor) -> None:
        spec = self.spec
        q0, q1 = spec.q_range(i)
        bounds = (_I64 * (2 * len(spans)))(*(x for k0, k1, _ in spans for x in (k0, k1)))
        masks, strides = (_PTR * len(spans))(), (_I64 * (2 * len(spans)))()
        owners = []  # the masks' memory, alive for the call
        for s, (k0, k1, masked) in enumerate(spans):
            if masked:
                allowed = tile_mask(spec, tile_index(spec, q0, q1, k0, k1, scratch.device))
                owner, (pointer, _, _, sb, sh) = native._mask_layout(
                    allowed, (spec.batch, spec.heads, q1 - q0, k1 - k0))
                owners.append(owner)
                masks[s], strides[2 * s], strides[2 * s + 1] = pointer, sb, sh
        self._function(ctypes.byref(self.call), q0, q1, len(spans), bounds, masks, strides,
                       *(t.data_ptr() for t in sums), scratch.data_ptr())

