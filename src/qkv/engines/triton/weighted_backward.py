"""The backward Triton kernels of the weightings other than softmax (``weighted.py``): dK/dV
per key tile (``bwd_kv_kernel``, ELEMENTWISE and SOFTPICK, whose tiles need only their rows'
log Z and δ) and dQ per query tile (``bwd_q_kernel``, every kind; for STICK it also adds the
tiles' dK and dV, atomically). Conventions as in ``backward.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .backward import _l1_grad_rows, _term_grad_rows
from .groups import L1, SQDIST, STICK, KeyRows, WeightedRows
from .kernels import head_of, load_rows, pair_scores, query_rows, sq_norms, table_row, visit_tiles
from .weighted import (
    LN2,
    dropped,
    key_tile,
    scores_where_allowed,
    stick_weights,
    visit,
    weights_and_grad,
)


@triton.jit
def _dkv_tile(tile, state, R, X, SLOTS, S, T, C, MASKED: tl.constexpr):
    """One query tile of the dK/dV kernel: state (dk, dv, col_sum). The product terms work on
    the transposed tile, keys as rows, as softmax's kernel does."""
    dk, dv, col_sum = state
    offs_m = tile * T.BLOCK_M + tl.arange(0, T.BLOCK_M)
    q = load_rows(R.Qb, offs_m, R.sqm, S.NQ, T.D, R.offs_d)
    do = load_rows(R.DOb, offs_m, R.sdm, S.NQ, T.DV, R.offs_v)
    # +inf past Nq: e^(s - log Z) is then 0 on the padding rows, whatever their scores.
    log_z = tl.load(R.LSEb + offs_m, mask=offs_m < S.NQ, other=float("inf")) * LN2
    delta = tl.load(R.DELTAb + offs_m, mask=offs_m < S.NQ, other=0.0)
    if C.PRODUCTS:
        q_row = tl.minimum(offs_m, S.NQ - 1)[None, :]
        kv_col = tl.minimum(R.offs_n, S.NK - 1)[:, None]
        zt = tl.dot(R.k, tl.trans(q), input_precision=T.PRECISION)
        if C.KIND == SQDIST:
            qn = sq_norms(R.QNb, offs_m, S.NQ, C.KIND)
            zt = 2.0 * zt - R.kn[:, None] - qn[None, :]
        st, allowed = scores_where_allowed(zt, R.scale, R.b, R.h, q_row, kv_col,
                                           R.offs_n[:, None] < S.NK, S.OFFSET, SLOTS, C, MASKED)
        dpt = tl.dot(R.v, tl.trans(do), input_precision=T.PRECISION)
        dpt = dropped(dpt, R.bh, offs_m[None, :], R.offs_n[:, None], S, C)
        wt, dst = weights_and_grad(st, allowed, log_z[None, :], delta[None, :], dpt, C)
        wt = dropped(wt, R.bh, offs_m[None, :], R.offs_n[:, None], S, C)
        dv += tl.dot(wt.to(do.dtype), do, input_precision=T.PRECISION)
        zct = tl.minimum(zt, 0.0) if C.KIND == SQDIST else zt
        if C.HAS_MOD:
            dst = C.MOD_BWD_FN(zct * R.scale, dst, allowed, R.b, R.h, q_row, kv_col, S.OFFSET,
                               SLOTS, SLOTS, False)
        dzt = dst * R.scale
        if C.KIND == SQDIST:
            dzt = tl.where(zt <= 0.0, dzt, 0.0)
        dk += tl.dot(dzt.to(q.dtype), q, input_precision=T.PRECISION)
        col_sum += tl.sum(dzt, 1)
    else:  # the chunked terms (CUDA cores): query-major, like the dQ kernel
        q_idx = tl.minimum(offs_m, S.NQ - 1)[:, None]
        kv_idx = tl.minimum(R.offs_n, S.NK - 1)[None, :]
        QR = (R.Qb, offs_m, R.sqm, S.NQ)
        KR = (R.Kb, R.offs_n, R.skn, S.NK)
        z = pair_scores(q, R.k, 0.0, 0.0, QR, KR, SLOTS, T, C)
        s, allowed = scores_where_allowed(z, R.scale, R.b, R.h, q_idx, kv_idx,
                                          R.offs_n[None, :] < S.NK, S.OFFSET, SLOTS, C, MASKED)
        dp = tl.dot(do, tl.trans(R.v), input_precision=T.PRECISION)
        dp = dropped(dp, R.bh, offs_m[:, None], R.offs_n[None, :], S, C)
        w, ds = weights_and_grad(s, allowed, log_z[:, None], delta[:, None], dp, C)
        w = dropped(w, R.bh, offs_m[:, None], R.offs_n[None, :], S, C)
        dv += tl.dot(tl.trans(w.to(do.dtype)), do, input_precision=T.PRECISION)
        if C.HAS_MOD:
            ds = C.MOD_BWD_FN(z * R.scale, ds, allowed, R.b, R.h, q_idx, kv_idx, S.OFFSET,
                              SLOTS, SLOTS, False)
        dz = ds * R.scale
        if C.KIND == L1:
            _l1_grad_rows(tl.trans(dz), KR, QR, R.DKb, -1.0, T)
        else:
            _term_grad_rows(dz, QR, KR, R.DKb, SLOTS, SLOTS, T, C, True)
    return dk, dv, col_sum


@triton.jit
def bwd_kv_kernel(Q, K, V, DO, LSE, DELTA, SCALE, TABLE, NORMS, DK, DV, SLOTS, S, T, C):
    """Grid (ceil(Nk / BLOCK_N), B·Hkv): dK, dV for one key tile, summed over the query heads
    of its group and the query tiles of its column table (ELEMENTWISE and SOFTPICK)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // (S.H // T.GROUP)
    hk = pid_bh % (S.H // T.GROUP)
    Kb = head_of(K, b, hk)
    offs_n = pid_n * T.BLOCK_N + tl.arange(0, T.BLOCK_N)
    offs_d = tl.arange(0, T.D_PAD)
    offs_v = tl.arange(0, T.DV_PAD)
    k = load_rows(Kb, offs_n, K.sm, S.NK, T.D, offs_d)
    kn = sq_norms(NORMS[1] + pid_bh * S.NK, offs_n, S.NK, C.KIND)
    v = load_rows(head_of(V, b, hk), offs_n, V.sm, S.NK, T.DV, offs_v)
    DKb = DK + pid_bh * S.NK * T.D
    dk = tl.zeros([T.BLOCK_N, T.D_PAD], dtype=tl.float32)
    dv = tl.zeros([T.BLOCK_N, T.DV_PAD], dtype=tl.float32)
    col_sum = tl.zeros([T.BLOCK_N], dtype=tl.float32)
    for g in range(T.GROUP):
        h = hk * T.GROUP + g
        bh = b * S.H + h
        R = KeyRows(
            k=k, kn=kn, v=v, Kb=Kb, DKb=DKb, offs_n=offs_n, offs_d=offs_d, offs_v=offs_v,
            b=b, h=h, bh=bh, scale=tl.load(SCALE + h), Qb=head_of(Q, b, h),
            DOb=head_of(DO, b, h), LSEb=LSE + bh * S.NQ, DELTAb=DELTA + bh * S.NQ,
            QNb=NORMS[0] + bh * S.NQ, sqm=Q.sm, skn=K.sm, sdm=DO.sm,
        )
        dk, dv, col_sum = visit_tiles(table_row(TABLE, b, h, pid_n), (dk, dv, col_sum),
                                      _dkv_tile, R, None, SLOTS, S, T, C)
    keep = offs_n[:, None] < S.NK
    if C.PRODUCTS:  # stored once, in DK's dtype (the chunked terms added into fp32 DK above)
        if C.KIND == SQDIST:
            dk = 2.0 * dk - 2.0 * col_sum[:, None] * k.to(tl.float32)
        tl.store(DKb + offs_n[:, None] * T.D + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=keep & (offs_d[None, :] < T.D))
    tl.store(DV + pid_bh * S.NK * T.DV + offs_n[:, None] * T.DV + offs_v[None, :],
             dv.to(DV.dtype.element_ty), mask=keep & (offs_v[None, :] < T.DV))


@triton.jit
def _stick_grad(s, allowed, dp, delta, spent, later):
    """A row-major stick-breaking tile's weights and d(loss)/d(score), and the rows' carries
    (mass spent, Σ g over the keys seen) with the tile added: g_m − σ(s_m) (δ − Σ_{j>m} g_j),
    g = dp·w."""
    w, spent = stick_weights(s, allowed, spent)
    g = dp * w
    after = tl.cumsum(g, 1, reverse=True) - g + later[:, None]
    ds = tl.where(allowed, g - tl.sigmoid(s) * (delta[:, None] - after), 0.0)
    return w, ds, spent, later + tl.sum(g, 1)


@triton.jit
def _dq_tile(tile, state, R, X, SLOTS, S, T, C, MASKED: tl.constexpr):
    """One key tile of the dQ kernel: state (dq, row_sum, dscale, spent, later), the last two
    stick-breaking's carries. X: the rows' ``WeightedRows``."""
    dq, row_sum, dscale, spent, later = state
    offs_n, kv_idx, k, v, z, s, allowed = key_tile(tile, R, SLOTS, S, T, C, MASKED)
    dp = tl.dot(X.do, tl.trans(v), input_precision=T.PRECISION)
    dp = dropped(dp, R.pid_bh, R.offs_m[:, None], offs_n[None, :], S, C)
    keys = offs_n[:, None] < S.NK
    if C.WEIGHTS == STICK:
        w, ds, spent, later = _stick_grad(s, allowed, dp, X.delta, spent, later)
        w = dropped(w, R.pid_bh, R.offs_m[:, None], offs_n[None, :], S, C)
        dv = tl.dot(tl.trans(w.to(X.do.dtype)), X.do, input_precision=T.PRECISION)
        tl.atomic_add(X.DVb + offs_n[:, None] * T.DV + R.offs_v[None, :], dv,
                      mask=keys & (R.offs_v[None, :] < T.DV))
    else:
        _, ds = weights_and_grad(s, allowed, X.lse[:, None], X.delta[:, None], dp, C)
    zc = z
    if C.KIND == SQDIST:
        zc = tl.minimum(z, 0.0)
    if C.HAS_MOD:
        ds = C.MOD_BWD_FN(zc * R.scale, ds, allowed, R.b, R.h, R.q_idx, kv_idx, S.OFFSET, SLOTS,
                          X.GRADS, C.SLOT_GRAD)
    if C.SCALE_GRAD:
        dscale += tl.sum(ds * zc, 1)
    dz = ds * R.scale
    if C.KIND == SQDIST:
        dz = tl.where(z <= 0.0, dz, 0.0)
    if C.PRODUCTS:
        dq += tl.dot(dz.to(k.dtype), k, input_precision=T.PRECISION)
        row_sum += tl.sum(dz, 1)
        if C.WEIGHTS == STICK:
            dk = tl.dot(tl.trans(dz.to(R.q.dtype)), R.q, input_precision=T.PRECISION)
            if C.KIND == SQDIST:
                dk = 2.0 * dk - 2.0 * tl.sum(dz, 0)[:, None] * k.to(tl.float32)
            tl.atomic_add(X.DKb + offs_n[:, None] * T.D + R.offs_d[None, :], dk,
                          mask=keys & (R.offs_d[None, :] < T.D))
    else:
        tl.static_assert(C.WEIGHTS != STICK, "stick-breaking runs the product terms only")
        QR = (R.Qb, R.offs_m, R.sqm, S.NQ)
        KR = (R.Kb, offs_n, R.skn, S.NK)
        if C.KIND == L1:
            _l1_grad_rows(dz, QR, KR, X.DQb, -1.0, T)
        else:
            _term_grad_rows(dz, QR, KR, X.DQb, SLOTS, X.GRADS, T, C, False)
    return dq, row_sum, dscale, spent, later


@triton.jit
def bwd_q_kernel(Q, K, V, DO, LSE, DELTA, SCALE, TABLE, NORMS, DQ, DK, DV, DSCALE, SLOTS, GRADS,
                 S, T, C):
    """Grid (ceil(Nq / BLOCK_M), B·H): dQ for one query tile, the gradients of the scale
    (DSCALE) and of the modifier's tensors (GRADS); for STICK also the tiles' dK and dV,
    added into fp32 DK (B, Hkv, Nk, D) and DV (B, Hkv, Nk, Dv)."""
    R = query_rows(Q, K, V, NORMS, SCALE, S, T, C)
    kv_rows = R.b * (S.H // T.GROUP) + R.h // T.GROUP
    X = WeightedRows(
        do=load_rows(head_of(DO, R.b, R.h), R.offs_m, DO.sm, S.NQ, T.DV, R.offs_v),
        lse=tl.load(LSE + R.pid_bh * S.NQ + R.offs_m, mask=R.offs_m < S.NQ,
                    other=float("inf")) * LN2,
        delta=tl.load(DELTA + R.pid_bh * S.NQ + R.offs_m, mask=R.offs_m < S.NQ, other=0.0),
        DQb=DQ + R.pid_bh * S.NQ * T.D, DKb=DK + kv_rows * S.NK * T.D,
        DVb=DV + kv_rows * S.NK * T.DV, GRADS=GRADS,
    )
    dq = tl.zeros([T.BLOCK_M, T.D_PAD], dtype=tl.float32)
    rows = tl.zeros([T.BLOCK_M], dtype=tl.float32)
    row = table_row(TABLE, R.b, R.h, tl.program_id(0))
    dq, row_sum, dscale, _, _ = visit(row, (dq, rows, rows, rows, rows), _dq_tile, R, X, SLOTS,
                                      S, T, C)
    keep = (R.offs_m[:, None] < S.NQ) & (R.offs_d[None, :] < T.D)
    if C.PRODUCTS:  # stored once, in DQ's dtype (the chunked terms added into fp32 DQ)
        if C.KIND == SQDIST:
            dq = 2.0 * dq - 2.0 * row_sum[:, None] * R.q.to(tl.float32)
        tl.store(X.DQb + R.offs_m[:, None] * T.D + R.offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=keep)
    if C.SCALE_GRAD:
        tl.atomic_add(DSCALE + R.h, tl.sum(dscale, 0))
