"""The backward Triton kernels: dK/dV per key tile (``bwd_kv_kernel``, over the query tiles of
its column table) and dQ per query tile (``bwd_q_kernel``), with FlashAttention-2's
``delta = rowsum(dO ∘ O)``. Conventions as in ``kernels.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .groups import L1, SQDIST, BackwardRows, KeyRows
from .kernels import (
    dropout_keep,
    head_of,
    key_tile,
    load_chunk,
    load_rows,
    logits,
    pair_scores,
    query_rows,
    sq_norms,
    table_row,
    visit_tiles,
)


@triton.jit
def _l1_grad_rows(dz, XR, YR, OUT, sign, T):
    """OUT[x] += sign · Σ_y dz[x, y] · sign(X[x] - Y[y]) for L1, chunk by chunk over D (dz is
    (rows of X, rows of Y); XR, YR: (base, offsets, row stride, count)); the program owns rows
    XR[1] of OUT, a contiguous (count, D) fp32 matrix."""
    for d0 in range(0, T.D_PAD, T.BLOCK_D):
        offs_c = d0 + tl.arange(0, T.BLOCK_D)
        diff = load_chunk(XR, offs_c, T.D)[:, None, :] - load_chunk(YR, offs_c, T.D)[None, :, :]
        sgn = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        grad = tl.sum(dz[:, :, None] * sgn, 1) * sign
        ptrs = OUT + XR[1][:, None] * T.D + offs_c[None, :]
        keep = (XR[1][:, None] < XR[3]) & (offs_c[None, :] < T.D)
        tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + grad, mask=keep)


@triton.jit
def _term_grad_rows(dz, QR, KR, OUT, SLOTS, GRADS, T, C, FOR_KEYS: tl.constexpr):
    """For a traced term and dz (BLOCK_M, BLOCK_N) = d(loss)/d(z) of query rows QR and key
    rows KR: OUT[m] += Σ_n dz·∂term/∂q (FOR_KEYS False, OUT the queries' rows) or OUT[n] +=
    Σ_m dz·∂term/∂k (FOR_KEYS True, the keys' rows), chunk by chunk over D; for the queries,
    with C.SLOT_GRAD, also the gradients of the tensors the term reads (``term_grad_fn``)."""
    dz3 = dz[:, :, None]
    for d0 in range(0, T.D_PAD, T.BLOCK_D):
        offs_c = d0 + tl.arange(0, T.BLOCK_D)
        d_ok = offs_c < T.D
        qc = load_chunk(QR, offs_c, T.D)[:, None, :]
        kc = load_chunk(KR, offs_c, T.D)[None, :, :]
        pd1 = tl.minimum(offs_c, T.D - 1)
        pd = pd1[None, None, :]
        if FOR_KEYS:
            part = tl.where((dz3 != 0.0) & d_ok[None, None, :],
                            dz3 * C.TERM_DK_FN(qc, kc, pd, SLOTS), 0.0)
            ptrs = OUT + KR[1][:, None] * T.D + offs_c[None, :]
            keep = (KR[1][:, None] < KR[3]) & d_ok[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + tl.sum(part, 0), mask=keep)
        else:
            part = tl.where((dz3 != 0.0) & d_ok[None, None, :],
                            dz3 * C.TERM_DQ_FN(qc, kc, pd, SLOTS), 0.0)
            ptrs = OUT + QR[1][:, None] * T.D + offs_c[None, :]
            keep = (QR[1][:, None] < QR[3]) & d_ok[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + tl.sum(part, 1), mask=keep)
            if C.SLOT_GRAD:
                dzd = tl.where(d_ok[None, None, :], dz3, 0.0)
                C.TERM_GRAD_FN(qc, kc, pd, SLOTS, dzd, pd1, d_ok, GRADS)


@triton.jit
def _dkv_tile(tile, state, R, X, SLOTS, S, T, C, MASKED: tl.constexpr):
    """One query tile of the dK/dV kernel: state (dk, dv, col_sum) updated. R: the key rows
    (``KeyRows``) and one query head of their group.

    The tensor-core terms work on the transposed tile, keys as rows: p and ds are then the
    left operands of dV's and dK's products as they stand. A query-major tile would transpose
    each through shared memory first (a store, a load and barriers per tile)."""
    dk, dv, col_sum = state
    offs_m = tile * T.BLOCK_M + tl.arange(0, T.BLOCK_M)
    q = load_rows(R.Qb, offs_m, R.sqm, S.NQ, T.D, R.offs_d)
    do = load_rows(R.DOb, offs_m, R.sdm, S.NQ, T.DV, R.offs_v)
    lse = tl.load(R.LSEb + offs_m, mask=offs_m < S.NQ, other=float("inf"))
    delta = tl.load(R.DELTAb + offs_m, mask=offs_m < S.NQ, other=0.0)
    if C.PRODUCTS:
        q_row = tl.minimum(offs_m, S.NQ - 1)[None, :]
        kv_col = tl.minimum(R.offs_n, S.NK - 1)[:, None]
        zt = tl.dot(R.k, tl.trans(q), input_precision=T.PRECISION)
        if C.KIND == SQDIST:
            qn = sq_norms(R.QNb, offs_m, S.NQ, C.KIND)
            zt = 2.0 * zt - R.kn[:, None] - qn[None, :]
        st = logits(zt, R.scale, R.b, R.h, q_row, kv_col, R.offs_n[:, None] < S.NK, S.OFFSET,
                    SLOTS, C, MASKED)
        pt = tl.exp2(st - lse[None, :])
        dpt = tl.dot(R.v, tl.trans(do), input_precision=T.PRECISION)
        if C.DROPOUT:
            keep = dropout_keep(S, R.bh, offs_m[None, :], R.offs_n[:, None])
            pt_kept = tl.where(keep, pt / (1.0 - S.DROPOUT_P), 0.0)
            dv += tl.dot(pt_kept.to(do.dtype), do, input_precision=T.PRECISION)
            dpt = tl.where(keep, dpt / (1.0 - S.DROPOUT_P), 0.0)
        else:
            dv += tl.dot(pt.to(do.dtype), do, input_precision=T.PRECISION)
        dst = pt * (dpt - delta[None, :])
        if C.HAS_MOD:
            zct = tl.minimum(zt, 0.0) if C.KIND == SQDIST else zt
            dst = C.MOD_BWD_FN(zct * R.scale, dst, pt > 0.0, R.b, R.h, q_row, kv_col, S.OFFSET,
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
        s = logits(z, R.scale, R.b, R.h, q_idx, kv_idx, R.offs_n[None, :] < S.NK, S.OFFSET,
                   SLOTS, C, MASKED)
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(R.v), input_precision=T.PRECISION)
        if C.DROPOUT:
            keep = dropout_keep(S, R.bh, offs_m[:, None], R.offs_n[None, :])
            p_kept = tl.where(keep, p / (1.0 - S.DROPOUT_P), 0.0)
            dv += tl.dot(tl.trans(p_kept.to(do.dtype)), do, input_precision=T.PRECISION)
            dp = tl.where(keep, dp / (1.0 - S.DROPOUT_P), 0.0)
        else:
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=T.PRECISION)
        ds = p * (dp - delta[:, None])
        if C.HAS_MOD:
            ds = C.MOD_BWD_FN(z * R.scale, ds, p > 0.0, R.b, R.h, q_idx, kv_idx, S.OFFSET,
                              SLOTS, SLOTS, False)
        dz = ds * R.scale
        if C.KIND == L1:
            _l1_grad_rows(tl.trans(dz), KR, QR, R.DKb, -1.0, T)
        else:
            _term_grad_rows(dz, QR, KR, R.DKb, SLOTS, SLOTS, T, C, True)
    return dk, dv, col_sum


@triton.jit
def bwd_kv_kernel(Q, K, V, DO, LSE, DELTA, SCALE, TABLE, NORMS, DK, DV, SLOTS, S, T, C):
    """Grid (ceil(Nk / BLOCK_N), B·Hkv): dK, dV (fp32, contiguous) for one key tile, summed
    over the query heads of its group and the query tiles of its column table."""
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
def _dq_tile(tile, state, R, X, SLOTS, S, T, C, MASKED: tl.constexpr):
    """One key tile of the dQ kernel: state (dq, row_sum, dscale) updated. X: the rows'
    ``BackwardRows``."""
    dq, row_sum, dscale = state
    offs_n, kv_idx, k, v, z, s = key_tile(tile, R, SLOTS, S, T, C, MASKED)
    p = tl.exp2(s - X.lse[:, None])
    dp = tl.dot(X.do, tl.trans(v), input_precision=T.PRECISION)
    if C.DROPOUT:
        keep = dropout_keep(S, R.pid_bh, R.offs_m[:, None], offs_n[None, :])
        dp = tl.where(keep, dp / (1.0 - S.DROPOUT_P), 0.0)
    ds = p * (dp - X.delta[:, None])
    zc = z
    if C.KIND == SQDIST:
        zc = tl.minimum(z, 0.0)
    if C.HAS_MOD:
        ds = C.MOD_BWD_FN(zc * R.scale, ds, p > 0.0, R.b, R.h, R.q_idx, kv_idx, S.OFFSET, SLOTS,
                          X.GRADS, C.SLOT_GRAD)
    if C.SCALE_GRAD:
        dscale += tl.sum(ds * zc, 1)
    dz = ds * R.scale
    if C.KIND == SQDIST:
        dz = tl.where(z <= 0.0, dz, 0.0)
    if C.PRODUCTS:
        dq += tl.dot(dz.to(k.dtype), k, input_precision=T.PRECISION)
        row_sum += tl.sum(dz, 1)
    else:
        QR = (R.Qb, R.offs_m, R.sqm, S.NQ)
        KR = (R.Kb, offs_n, R.skn, S.NK)
        if C.KIND == L1:
            _l1_grad_rows(dz, QR, KR, X.DQb, -1.0, T)
        else:
            _term_grad_rows(dz, QR, KR, X.DQb, SLOTS, X.GRADS, T, C, False)
    return dq, row_sum, dscale


@triton.jit
def bwd_q_kernel(Q, K, V, DO, LSE, DELTA, SCALE, TABLE, NORMS, DQ, DSCALE, SLOTS, GRADS, S, T,
                 C):
    """Grid (ceil(Nq / BLOCK_M), B·H): dQ (fp32, contiguous) for one query tile; also the
    gradients of the scale (DSCALE, (H,)) and of the score modifier's tensors (GRADS)."""
    R = query_rows(Q, K, V, NORMS, SCALE, S, T, C)
    X = BackwardRows(
        do=load_rows(head_of(DO, R.b, R.h), R.offs_m, DO.sm, S.NQ, T.DV, R.offs_v),
        lse=tl.load(LSE + R.pid_bh * S.NQ + R.offs_m, mask=R.offs_m < S.NQ, other=float("inf")),
        delta=tl.load(DELTA + R.pid_bh * S.NQ + R.offs_m, mask=R.offs_m < S.NQ, other=0.0),
        DQb=DQ + R.pid_bh * S.NQ * T.D, GRADS=GRADS,
    )
    dq = tl.zeros([T.BLOCK_M, T.D_PAD], dtype=tl.float32)
    row_sum = tl.zeros([T.BLOCK_M], dtype=tl.float32)
    dscale = tl.zeros([T.BLOCK_M], dtype=tl.float32)
    row = table_row(TABLE, R.b, R.h, tl.program_id(0))
    dq, row_sum, dscale = visit_tiles(row, (dq, row_sum, dscale), _dq_tile, R, X, SLOTS, S, T,
                                      C)
    keep = (R.offs_m[:, None] < S.NQ) & (R.offs_d[None, :] < T.D)
    if C.PRODUCTS:  # stored once, in DQ's dtype (the chunked terms added into fp32 DQ)
        if C.KIND == SQDIST:
            dq = 2.0 * dq - 2.0 * row_sum[:, None] * R.q.to(tl.float32)
        tl.store(X.DQb + R.offs_m[:, None] * T.D + R.offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=keep)
    if C.SCALE_GRAD:
        tl.atomic_add(DSCALE + R.h, tl.sum(dscale, 0))
