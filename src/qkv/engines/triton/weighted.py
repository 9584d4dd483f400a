"""The Triton kernels of the weightings other than softmax (``core.weighting``): forward,
weights and backward, one branch per ``lowering.WeightsKind`` (``C.WEIGHTS``). Softmax keeps
the kernels of ``kernels.py`` and ``backward.py``, its hot path; these reuse their loads,
pair scores and tile visits. Scores here are in natural units (softmax's are base 2, for
exp2), and the LSE slot holds each weighting's statistic in base 2, as softmax's.

- ELEMENTWISE (``Carry.NONE``): the weighting's function already ends the score modifier
  (``lowering.weighted_mod``), so a tile's weights are its scores, 0 where masked, and
  d(loss)/d(score) is dp, which ``MOD_BWD_FN`` carries back through the function.
- SOFTPICK (``Carry.MAX_SUM``): w = relu(e^s − 1) / (Σ |e^s − 1| + eps), with a running max
  m never below 0 and the sum scaled by e^(−m), as softmax's; LSE: log2 Z. Gradient:
  e^(s − log Z) ([s > 0] dp − sign(s) δ), δ = dout·out.
- STICK (``Carry.STICK``): key tiles from the nearest to the farthest (``visit_nearest_first``),
  each row carrying the softplus mass of the keys seen; LSE: that mass (log2 of the stick
  left). The backward runs by query tiles only (``bwd_q_kernel``): a key's gradient needs the
  mass and Σ g of the nearer keys of every row, which only a row pass carries, so its tiles
  add into fp32 dK and dV atomically. d(loss)/d s_m = g_m − σ(s_m) Σ_{j<=m} g_j, g = dp·w,
  and Σ_{j<=m} g = δ − Σ_{j>m} g.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .groups import ELEMENTWISE, SOFTPICK, SQDIST, STICK
from .kernels import (
    dropout_keep,
    head_of,
    load_key_rows,
    pair_scores,
    query_rows,
    sq_norms,
    table_row,
    visit_tiles,
)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def scores_where_allowed(z, scale, b, h, q_idx, kv_idx, key_ok, OFFSET, SLOTS, C,
                         APPLY_MASK: tl.constexpr):
    """Natural scores mod(scale·z) and where a key counts (a full tile of bools): inside the
    mask and Nk (APPLY_MASK), and for STICK before the query's position. The indices
    broadcast against z: (m, 1) and (1, n), or transposed."""
    if C.KIND == SQDIST:
        z = tl.minimum(z, 0.0)
    if C.HAS_MOD:
        s = C.MOD_FN(z * scale, b, h, q_idx, kv_idx, OFFSET, SLOTS)
    else:
        s = z * scale
    if APPLY_MASK:
        allowed = (q_idx >= 0) & key_ok  # a full tile of bools, whichever way round
        if C.HAS_MASK:
            allowed = allowed & C.MASK_FN(b, h, q_idx, kv_idx, OFFSET, SLOTS)
    else:
        # A full tile: every pair counts, which the compiler folds into the selects below
        # (comparisons of q_idx and kv_idx would be per-score instructions it cannot drop).
        allowed = tl.full(z.shape, True, tl.int1)
    if C.WEIGHTS == STICK:
        if C.INCLUDE_SELF:
            allowed = allowed & (kv_idx <= q_idx + OFFSET)
        else:
            allowed = allowed & (kv_idx < q_idx + OFFSET)
    # 0 where not allowed: a masked entry's value never reaches a formula (nor a NaN from it).
    return tl.where(allowed, s, 0.0), allowed


@triton.jit
def _exp(x):
    """e^x as exp2 (one MUFU instruction; tl.exp adds range handling): relative error a few
    1e-7 for the arguments here, a score less a row statistic (the rounding of x·log2 e adds
    |x|·6e-8)."""
    return tl.exp2(x * LOG2E)


@triton.jit
def _expm1_near_0(x):
    """e^x − 1 for |x| <= 1/4 by its series to x^6 (the rest below 5e-8 of the result):
    multiply-adds, with no cancellation near 0."""
    return x * (1.0 + x * (0.5 + x * (1 / 6 + x * (1 / 24 + x * (1 / 120 + x / 720)))))


@triton.jit
def softpick_terms(s, m):
    """e^(s−m) − e^(−m) = e^(−m) (e^s − 1) for a row statistic m (broadcast against s). Where
    |s| < 1/4 the difference would cancel, so e^s − 1 comes from its series; elsewhere
    |e^s − 1| >= 0.22 e^s, and the two exps' rounding grows at most 4.5x in the difference."""
    near_0 = tl.abs(s) < 0.25
    series = _expm1_near_0(tl.where(near_0, s, 0.0)) * _exp(-m)
    return tl.where(near_0, series, _exp(s - m) - _exp(-m))


@triton.jit
def stick_weights(s, keep, spent):
    """A row-major tile's stick-breaking weights σ(s_j) e^(−Σ_{l>j} softplus(s_l)), the keys
    of the nearer tiles in ``spent`` (per row), and ``spent`` with this tile's mass added."""
    soft = tl.log(1.0 + tl.exp(-tl.abs(s)))  # softplus(s) = max(s, 0) + soft
    mass = tl.where(keep, tl.maximum(s, 0.0) + soft, 0.0)
    after = tl.cumsum(mass, 1, reverse=True) - mass + spent[:, None]
    w = tl.where(keep, tl.exp(tl.minimum(s, 0.0) - soft - after), 0.0)  # log σ(s) - after
    return w, spent + tl.sum(mass, 1)


@triton.jit
def row_weights(s, allowed, log_z, C):
    """The weights of an ELEMENTWISE or SOFTPICK tile from its rows' log Z (broadcast)."""
    if C.WEIGHTS == ELEMENTWISE:
        w = tl.where(allowed, s, 0.0)
    else:
        tl.static_assert(C.WEIGHTS == SOFTPICK, "row_weights: elementwise or softpick")
        w = tl.where(allowed, tl.maximum(softpick_terms(s, log_z), 0.0), 0.0)
    return w


@triton.jit
def weights_and_grad(s, allowed, log_z, delta, dp, C):
    """(weights, d(loss)/d(score)) of an ELEMENTWISE or SOFTPICK tile from dp, log Z and δ
    (broadcast against s)."""
    w = row_weights(s, allowed, log_z, C)
    if C.WEIGHTS == ELEMENTWISE:
        ds = tl.where(allowed, dp, 0.0)
    else:
        base = tl.where(allowed, _exp(s - log_z), 0.0)
        sign = tl.where(s > 0.0, 1.0, tl.where(s < 0.0, -1.0, 0.0))
        ds = base * (tl.where(s > 0.0, dp, 0.0) - sign * delta)
    return w, ds


@triton.jit
def visit_nearest_first(table_row, state, TILE: tl.constexpr, R, X, SLOTS, S, T, C):
    """``state`` through TILE for every tile a block-table row lists, from the highest key
    tile to the lowest: its partial and full lists (each ascending) merged from their ends."""
    n_partial = tl.load(table_row)
    n_full = tl.load(table_row + 1)
    i_p = n_partial - 1
    i_f = n_full - 1
    for _ in range(n_partial + n_full):
        t_p = tl.load(table_row + 2 + i_p, mask=i_p >= 0, other=-1)
        t_f = tl.load(table_row + 2 + n_partial + i_f, mask=i_f >= 0, other=-1)
        if t_p > t_f:
            state = TILE(t_p, state, R, X, SLOTS, S, T, C, True)
            i_p -= 1
        else:
            state = TILE(t_f, state, R, X, SLOTS, S, T, C, False)
            i_f -= 1
    return state


@triton.jit
def visit(table_row, state, TILE: tl.constexpr, R, X, SLOTS, S, T, C):
    """``state`` through TILE in the order the weighting needs."""
    if C.WEIGHTS == STICK:
        state = visit_nearest_first(table_row, state, TILE, R, X, SLOTS, S, T, C)
    else:
        state = visit_tiles(table_row, state, TILE, R, X, SLOTS, S, T, C)
    return state


@triton.jit
def key_tile(tile, R, SLOTS, S, T, C, MASKED: tl.constexpr):
    """Key tile ``tile`` against a program's query rows: offsets, kv_idx, k, v, z, the natural
    scores and where they count."""
    offs_n = tile * T.BLOCK_N + tl.arange(0, T.BLOCK_N)
    v = load_key_rows(R.Vb, offs_n, R.svn, S.NK, T.DV, R.offs_v, MASKED)
    kv_idx = tl.minimum(offs_n, S.NK - 1)[None, :]
    k = R.q
    if C.PRODUCTS:
        k = load_key_rows(R.Kb, offs_n, R.skn, S.NK, T.D, R.offs_d, MASKED)
    kn = sq_norms(R.KNb, offs_n, S.NK, C.KIND)
    z = pair_scores(R.q, k, R.qn, kn, (R.Qb, R.offs_m, R.sqm, S.NQ), (R.Kb, offs_n, R.skn, S.NK),
                    SLOTS, T, C)
    s, allowed = scores_where_allowed(z, R.scale, R.b, R.h, R.q_idx, kv_idx,
                                      offs_n[None, :] < S.NK, S.OFFSET, SLOTS, C, MASKED)
    return offs_n, kv_idx, k, v, z, s, allowed


@triton.jit
def dropped(w, bh, rows, keys, S, C):
    """w with dropout applied (kept entries scaled by 1 / (1 - p))."""
    if C.DROPOUT:
        w = tl.where(dropout_keep(S, bh, rows, keys), w / (1.0 - S.DROPOUT_P), 0.0)
    return w


@triton.jit
def _fwd_tile(tile, state, R, X, SLOTS, S, T, C, MASKED: tl.constexpr):
    """One key tile of the forward: state (m_i, l_i, acc); l_i is softpick's sum and
    stick-breaking's mass spent, m_i softpick's max."""
    m_i, l_i, acc = state
    offs_n, kv_idx, k, v, z, s, allowed = key_tile(tile, R, SLOTS, S, T, C, MASKED)
    if C.WEIGHTS == ELEMENTWISE:
        w = s
    elif C.WEIGHTS == SOFTPICK:
        m_new = tl.maximum(m_i, tl.max(tl.where(allowed, s, float("-inf")), 1))
        d = softpick_terms(s, m_new[:, None])
        w = tl.where(allowed, tl.maximum(d, 0.0), 0.0)
        alpha = _exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(tl.where(allowed, tl.abs(d), 0.0), 1)
        acc = acc * alpha[:, None]
        m_i = m_new
    else:
        tl.static_assert(C.WEIGHTS == STICK, "unknown weighting kind")
        w, l_i = stick_weights(s, allowed, l_i)
    w = dropped(w, R.pid_bh, R.offs_m[:, None], offs_n[None, :], S, C)
    acc = tl.dot(w.to(v.dtype), v, acc, input_precision=T.PRECISION)
    return m_i, l_i, acc


@triton.jit
def fwd_kernel(Q, K, V, O, LSE, SCALE, TABLE, NORMS, SLOTS, S, T, C):
    """Grid (ceil(Nq / BLOCK_M), B·H): O (B, H, Nq, Dv) and the statistic LSE (B, H, Nq),
    base 2: log2 Z (softpick), the mass spent times log2 e (stick-breaking), 0 (elementwise)."""
    R = query_rows(Q, K, V, NORMS, SCALE, S, T, C)
    m_i = tl.zeros([T.BLOCK_M], dtype=tl.float32)  # softpick's max starts at its floor, 0
    l_i = tl.zeros([T.BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([T.BLOCK_M, T.DV_PAD], dtype=tl.float32)
    row = table_row(TABLE, R.b, R.h, tl.program_id(0))
    m_i, l_i, acc = visit(row, (m_i, l_i, acc), _fwd_tile, R, None, SLOTS, S, T, C)
    if C.WEIGHTS == SOFTPICK:
        z = l_i + C.EPS * tl.exp(-m_i)  # > 0: eps > 0
        out = acc / z[:, None]
        stat = (m_i + tl.log(z)) * LOG2E
    else:
        out = acc
        stat = l_i * LOG2E
    keep = (R.offs_m[:, None] < S.NQ) & (R.offs_v[None, :] < T.DV)
    tl.store(head_of(O, R.b, R.h) + R.offs_m[:, None] * O.sm + R.offs_v[None, :],
             out.to(O.ptr.dtype.element_ty), mask=keep)
    tl.store(LSE + R.pid_bh * S.NQ + R.offs_m, stat, mask=R.offs_m < S.NQ)


@triton.jit
def _weights_tile(tile, spent, R, X, SLOTS, S, T, C, MASKED: tl.constexpr):
    """The weights of one key tile, stored into X = (W, log Z of the rows)."""
    W, log_z = X
    offs_n, _, _, _, _, s, allowed = key_tile(tile, R, SLOTS, S, T, C, MASKED)
    if C.WEIGHTS == STICK:
        w, spent = stick_weights(s, allowed, spent)
    else:
        w = row_weights(s, allowed, log_z[:, None], C)
    w = dropped(w, R.pid_bh, R.offs_m[:, None], offs_n[None, :], S, C)
    inside = (R.offs_m[:, None] < S.NQ) & (offs_n[None, :] < S.NK)
    tl.store(head_of(W, R.b, R.h) + R.offs_m[:, None] * W.sm + offs_n[None, :],
             w.to(W.ptr.dtype.element_ty), mask=inside)
    return spent


@triton.jit
def weights_kernel(Q, K, W, LSE, SCALE, TABLE, NORMS, SLOTS, S, T, C):
    """Grid (ceil(Nq / BLOCK_M), B·H): the weights W (B, H, Nq, Nk) recomputed on every
    listed tile; unlisted (empty) tiles keep W's zeros."""
    R = query_rows(Q, K, K, NORMS, SCALE, S, T, C)
    lse = tl.load(LSE + R.pid_bh * S.NQ + R.offs_m, mask=R.offs_m < S.NQ, other=float("inf"))
    row = table_row(TABLE, R.b, R.h, tl.program_id(0))
    visit(row, tl.zeros([T.BLOCK_M], dtype=tl.float32), _weights_tile, R, (W, lse * LN2),
          SLOTS, S, T, C)
