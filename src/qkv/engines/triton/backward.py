"""The backward Triton kernels: dK/dV per key tile (``bwd_kv_kernel``, over the query tiles of
its column table) and dQ per query tile (``bwd_q_kernel``), with FlashAttention-2's
``delta = rowsum(dO ∘ O)``. Conventions as in ``kernels.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .kernels import dropout_keep, key_tile, load_rows, logits, pair_scores, sq_norms, tile_run


@triton.jit
def _l1_grad_rows(dz, Xb, Yb, offs_x, offs_y, sx, sy, NX, NY, OUT, so, sign,
                  D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[x] += sign · Σ_y dz[x, y] · sign(X[x] - Y[y]) for neg_l1, chunk by chunk over D
    (dz is (rows of X, rows of Y)); the program owns rows ``offs_x`` of OUT."""
    for d0 in range(0, D_PAD, BLOCK_D):
        offs_c = d0 + tl.arange(0, BLOCK_D)
        xc = load_rows(Xb, offs_x, sx, NX, D, offs_c).to(tl.float32)
        yc = load_rows(Yb, offs_y, sy, NY, D, offs_c).to(tl.float32)
        diff = xc[:, None, :] - yc[None, :, :]
        sgn = tl.where(diff > 0, 1.0, tl.where(diff < 0, -1.0, 0.0))
        grad = tl.sum(dz[:, :, None] * sgn, 1) * sign
        ptrs = OUT + offs_x[:, None] * so + offs_c[None, :]
        keep = (offs_x[:, None] < NX) & (offs_c[None, :] < D)
        tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + grad, mask=keep)


@triton.jit
def _term_grad_rows(dz, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, OUT, A0, A1, A2, A3, AS,
                    G0, G1, G2, G3, D: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK_D: tl.constexpr, FOR_KEYS: tl.constexpr, TERM_D_FN: tl.constexpr,
                    TERM_GRAD: tl.constexpr, TERM_GRAD_FN: tl.constexpr):
    """For a traced term and dz (BLOCK_M, BLOCK_N) = d(loss)/d(z): OUT[m] += Σ_n dz·∂term/∂q
    (FOR_KEYS False, OUT rows offs_m) or OUT[n] += Σ_m dz·∂term/∂k (FOR_KEYS True, rows
    offs_n), chunk by chunk over D; with TERM_GRAD, also the gradients of the tensors the
    term reads (``term_grad_fn``)."""
    dz3 = dz[:, :, None]
    for d0 in range(0, D_PAD, BLOCK_D):
        offs_c = d0 + tl.arange(0, BLOCK_D)
        d_ok = offs_c < D
        qc = load_rows(Qb, offs_m, sqm, NQ, D, offs_c).to(tl.float32)[:, None, :]
        kc = load_rows(Kb, offs_n, skn, NK, D, offs_c).to(tl.float32)[None, :, :]
        pd1 = tl.minimum(offs_c, D - 1)
        pd = pd1[None, None, :]
        part = tl.where((dz3 != 0.0) & d_ok[None, None, :],
                        dz3 * TERM_D_FN(qc, kc, pd, A0, A1, A2, A3, AS), 0.0)
        if FOR_KEYS:
            ptrs = OUT + offs_n[:, None] * D + offs_c[None, :]
            keep = (offs_n[:, None] < NK) & d_ok[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + tl.sum(part, 0), mask=keep)
        else:
            ptrs = OUT + offs_m[:, None] * D + offs_c[None, :]
            keep = (offs_m[:, None] < NQ) & d_ok[None, :]
            tl.store(ptrs, tl.load(ptrs, mask=keep, other=0.0) + tl.sum(part, 1), mask=keep)
        if TERM_GRAD:
            dzd = tl.where(d_ok[None, None, :], dz3, 0.0)
            TERM_GRAD_FN(qc, kc, pd, A0, A1, A2, A3, AS, dzd, pd1, d_ok, G0, G1, G2, G3)


@triton.jit
def _dkv_tile(tile, dk, dv, col_sum, k, kn, v, Qb, Kb, DOb, DKb, LSE, DELTA, QN, offs_n, offs_d,
              offs_v, scale, b, h, H, sqm, skn, sdm, NQ, NK, OFFSET, SEED, DROPOUT_P,
              A0, A1, A2, A3, AS, D: tl.constexpr, DVD: tl.constexpr, D_PAD: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
              KERNEL: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_MASK: tl.constexpr,
              MASK_FN: tl.constexpr, HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr,
              MOD_BWD_FN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
              TERM_FN: tl.constexpr, TERM_DK_FN: tl.constexpr, TERM_GRAD_FN: tl.constexpr):
    """One query tile of the dK/dV kernel: (dk, dv, col_sum) updated. ``kn``: the key rows'
    squared norms, QN: the query norms (B, H, Nq) (both read for neg_sqdist).

    The tensor-core terms work on the transposed tile, keys as rows: p and ds are then the
    left operands of dV's and dK's products as they stand. In the query-major tile each was
    transposed through shared memory first (a store, a load and barriers per tile)."""
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q = load_rows(Qb, offs_m, sqm, NQ, D, offs_d)
    do = load_rows(DOb, offs_m, sdm, NQ, DVD, offs_v)
    lse = tl.load(LSE + (b * H + h) * NQ + offs_m, mask=offs_m < NQ, other=float("inf"))
    delta = tl.load(DELTA + (b * H + h) * NQ + offs_m, mask=offs_m < NQ, other=0.0)
    if KERNEL < 2:
        q_row = tl.minimum(offs_m, NQ - 1)[None, :]
        kv_col = tl.minimum(offs_n, NK - 1)[:, None]
        zt = tl.dot(k, tl.trans(q), input_precision=PRECISION)
        if KERNEL == 1:
            qn = sq_norms(QN + (b * H + h) * NQ, offs_m, NQ, KERNEL)
            zt = 2.0 * zt - kn[:, None] - qn[None, :]
        st = logits(zt, scale, b, h, q_row, kv_col, offs_n[:, None] < NK, OFFSET, A0, A1, A2,
                    A3, AS, KERNEL, APPLY_MASK, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN)
        pt = tl.exp2(st - lse[None, :])
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        if DROPOUT:
            keep = dropout_keep(SEED, b * H + h, offs_m[None, :], offs_n[:, None], NK,
                                DROPOUT_P)
            pt_kept = tl.where(keep, pt / (1.0 - DROPOUT_P), 0.0)
            dv += tl.dot(pt_kept.to(do.dtype), do, input_precision=PRECISION)
            dpt = tl.where(keep, dpt / (1.0 - DROPOUT_P), 0.0)
        else:
            dv += tl.dot(pt.to(do.dtype), do, input_precision=PRECISION)
        dst = pt * (dpt - delta[None, :])
        if HAS_MOD:
            zct = tl.minimum(zt, 0.0) if KERNEL == 1 else zt
            dst = MOD_BWD_FN(zct * scale, dst, pt > 0.0, b, h, q_row, kv_col, OFFSET,
                             A0, A1, A2, A3, AS, AS, AS, AS, AS, False)
        dzt = dst * scale
        if KERNEL == 1:
            dzt = tl.where(zt <= 0.0, dzt, 0.0)
        dk += tl.dot(dzt.to(q.dtype), q, input_precision=PRECISION)
        col_sum += tl.sum(dzt, 1)
    else:  # the chunked terms (CUDA cores): query-major, like the dQ kernel
        q_idx = tl.minimum(offs_m, NQ - 1)[:, None]
        kv_idx = tl.minimum(offs_n, NK - 1)[None, :]
        z = pair_scores(q, k, 0.0, 0.0, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, A0, A1, A2,
                        A3, AS, KERNEL, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, TERM_FN)
        s = logits(z, scale, b, h, q_idx, kv_idx, offs_n[None, :] < NK, OFFSET, A0, A1, A2,
                   A3, AS, KERNEL, APPLY_MASK, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN)
        p = tl.exp2(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        if DROPOUT:
            keep = dropout_keep(SEED, b * H + h, offs_m[:, None], offs_n[None, :], NK,
                                DROPOUT_P)
            p_kept = tl.where(keep, p / (1.0 - DROPOUT_P), 0.0)
            dv += tl.dot(tl.trans(p_kept.to(do.dtype)), do, input_precision=PRECISION)
            dp = tl.where(keep, dp / (1.0 - DROPOUT_P), 0.0)
        else:
            dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if HAS_MOD:
            ds = MOD_BWD_FN(z * scale, ds, p > 0.0, b, h, q_idx, kv_idx, OFFSET,
                            A0, A1, A2, A3, AS, AS, AS, AS, AS, False)
        dz = ds * scale
        if KERNEL == 2:
            _l1_grad_rows(tl.trans(dz), Kb, Qb, offs_n, offs_m, skn, sqm, NK, NQ, DKb, D,
                          -1.0, D, D_PAD, BLOCK_D)
        else:
            _term_grad_rows(dz, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, DKb, A0, A1,
                            A2, A3, AS, AS, AS, AS, AS, D, D_PAD, BLOCK_D, True,
                            TERM_DK_FN, False, TERM_GRAD_FN)
    return dk, dv, col_sum


@triton.jit
def bwd_kv_kernel(
    Q, K, V, DO, LSE, DELTA, SCALE, TABLE, QN, KN, DK, DV, A0, A1, A2, A3, AS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, stb, sth, stm,
    H, HKV, NQ, NK, OFFSET, SEED, DROPOUT_P,
    GROUP: tl.constexpr, D: tl.constexpr, DVD: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KERNEL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_FN: tl.constexpr,
    HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr, MOD_BWD_FN: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, TERM_FN: tl.constexpr,
    TERM_DQ_FN: tl.constexpr, TERM_DK_FN: tl.constexpr, TERM_GRAD: tl.constexpr,
    TERM_GRAD_FN: tl.constexpr,
):
    """Grid (ceil(Nk / BLOCK_N), B·Hkv): dK, dV (fp32, contiguous) for one key tile, summed
    over the query heads of its group and the query tiles of its column table."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // HKV
    hk = pid_bh % HKV
    Kb = K + b * skb + hk * skh
    Vb = V + b * svb + hk * svh
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    k = load_rows(Kb, offs_n, skn, NK, D, offs_d)
    kn = sq_norms(KN + pid_bh * NK, offs_n, NK, KERNEL)
    v = load_rows(Vb, offs_n, svn, NK, DVD, offs_v)
    DKb = DK + pid_bh * NK * D
    dk = tl.zeros([BLOCK_N, D_PAD], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, DV_PAD], dtype=tl.float32)
    col_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        scale = tl.load(SCALE + h)
        Qb = Q + b * sqb + h * sqh
        DOb = DO + b * sdb + h * sdh
        col = TABLE + b * stb + h * sth + pid_n * stm
        n_partial = tl.load(col)
        n_full = tl.load(col + 1)
        for phase in tl.static_range(2):
            lo = 0 if phase == 0 else n_partial
            count = n_partial if phase == 0 else n_full
            first, consecutive = tile_run(col, lo, count)
            if phase == 1 and consecutive:  # full tiles, usually one run
                for j in range(0, count):
                    dk, dv, col_sum = _dkv_tile(
                        first + j,
                        dk, dv, col_sum, k, kn, v, Qb, Kb, DOb, DKb, LSE, DELTA, QN, offs_n,
                        offs_d, offs_v, scale, b, h, H, sqm, skn, sdm, NQ, NK, OFFSET,
                        SEED, DROPOUT_P, A0, A1, A2, A3, AS, D, DVD, D_PAD, BLOCK_M, BLOCK_N,
                        BLOCK_D, KERNEL, phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN,
                        MOD_BWD_FN, DROPOUT, PRECISION, TERM_FN, TERM_DK_FN, TERM_GRAD_FN)
            else:
                for j in range(lo, lo + count):
                    dk, dv, col_sum = _dkv_tile(
                        tl.load(col + 2 + j),
                        dk, dv, col_sum, k, kn, v, Qb, Kb, DOb, DKb, LSE, DELTA, QN, offs_n,
                        offs_d, offs_v, scale, b, h, H, sqm, skn, sdm, NQ, NK, OFFSET,
                        SEED, DROPOUT_P, A0, A1, A2, A3, AS, D, DVD, D_PAD, BLOCK_M, BLOCK_N,
                        BLOCK_D, KERNEL, phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN,
                        MOD_BWD_FN, DROPOUT, PRECISION, TERM_FN, TERM_DK_FN, TERM_GRAD_FN)
    keep = offs_n[:, None] < NK
    if KERNEL < 2:  # stored once, in DK's dtype (the chunked terms added into fp32 DK above)
        if KERNEL == 1:
            dk = 2.0 * dk - 2.0 * col_sum[:, None] * k.to(tl.float32)
        tl.store(DKb + offs_n[:, None] * D + offs_d[None, :], dk.to(DK.dtype.element_ty),
                 mask=keep & (offs_d[None, :] < D))
    tl.store(DV + pid_bh * NK * DVD + offs_n[:, None] * DVD + offs_v[None, :],
             dv.to(DV.dtype.element_ty), mask=keep & (offs_v[None, :] < DVD))


@triton.jit
def _dq_tile(tile, dq, row_sum, dscale, q, qn, do, lse, delta, Qb, Kb, Vb, KNb, DQb, offs_m,
             offs_d, offs_v, q_idx, scale, b, h, pid_bh, sqm, skn, svn, NQ, NK, OFFSET, SEED,
             DROPOUT_P, A0, A1, A2, A3, AS, G0, G1, G2, G3, D: tl.constexpr,
             DVD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KERNEL: tl.constexpr,
             APPLY_MASK: tl.constexpr, HAS_MASK: tl.constexpr, MASK_FN: tl.constexpr,
             HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr, MOD_BWD_FN: tl.constexpr,
             MOD_GRAD: tl.constexpr, SCALE_GRAD: tl.constexpr, DROPOUT: tl.constexpr,
             PRECISION: tl.constexpr, TERM_FN: tl.constexpr, TERM_DQ_FN: tl.constexpr,
             TERM_GRAD: tl.constexpr, TERM_GRAD_FN: tl.constexpr):
    """One key tile of the dQ kernel: (dq, row_sum, dscale) updated."""
    offs_n, kv_idx, k, v, z, s = key_tile(
        tile, q, qn, Qb, Kb, Vb, KNb, offs_m, offs_d, offs_v, q_idx, scale, b, h, sqm, skn, svn,
        NQ, NK, OFFSET, A0, A1, A2, A3, AS, D, DVD, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, KERNEL,
        APPLY_MASK, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN, PRECISION, TERM_FN)
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    if DROPOUT:
        keep = dropout_keep(SEED, pid_bh, offs_m[:, None], offs_n[None, :], NK, DROPOUT_P)
        dp = tl.where(keep, dp / (1.0 - DROPOUT_P), 0.0)
    ds = p * (dp - delta[:, None])
    zc = z
    if KERNEL == 1:
        zc = tl.minimum(z, 0.0)
    if HAS_MOD:
        ds = MOD_BWD_FN(zc * scale, ds, p > 0.0, b, h, q_idx, kv_idx, OFFSET,
                        A0, A1, A2, A3, AS, G0, G1, G2, G3, MOD_GRAD)
    if SCALE_GRAD:
        dscale += tl.sum(ds * zc, 1)
    dz = ds * scale
    if KERNEL == 1:
        dz = tl.where(z <= 0.0, dz, 0.0)
    if KERNEL == 2:
        _l1_grad_rows(dz, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, DQb, D, -1.0,
                      D, D_PAD, BLOCK_D)
    elif KERNEL == 3:
        _term_grad_rows(dz, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, DQb, A0, A1, A2,
                        A3, AS, G0, G1, G2, G3, D, D_PAD, BLOCK_D, False, TERM_DQ_FN,
                        TERM_GRAD, TERM_GRAD_FN)
    else:
        dq += tl.dot(dz.to(k.dtype), k, input_precision=PRECISION)
        row_sum += tl.sum(dz, 1)
    return dq, row_sum, dscale


@triton.jit
def bwd_q_kernel(
    Q, K, V, DO, LSE, DELTA, SCALE, TABLE, QN, KN, DQ, DSCALE, A0, A1, A2, A3, AS, G0, G1, G2,
    G3,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sdb, sdh, sdm, stb, sth, stm,
    H, NQ, NK, OFFSET, SEED, DROPOUT_P,
    GROUP: tl.constexpr, D: tl.constexpr, DVD: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KERNEL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_FN: tl.constexpr,
    HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr, MOD_BWD_FN: tl.constexpr,
    MOD_GRAD: tl.constexpr, SCALE_GRAD: tl.constexpr, DROPOUT: tl.constexpr,
    PRECISION: tl.constexpr, TERM_FN: tl.constexpr, TERM_DQ_FN: tl.constexpr,
    TERM_DK_FN: tl.constexpr, TERM_GRAD: tl.constexpr, TERM_GRAD_FN: tl.constexpr,
):
    """Grid (ceil(Nq / BLOCK_M), B·H): dQ (fp32, contiguous) for one query tile; also the
    gradients of the scale (DSCALE, (H,)) and of the score modifier's tensors (G0..G3)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    Qb = Q + b * sqb + h * sqh
    Kb = K + b * skb + (h // GROUP) * skh
    Vb = V + b * svb + (h // GROUP) * svh
    DOb = DO + b * sdb + h * sdh
    DQb = DQ + pid_bh * NQ * D
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    q_idx = tl.minimum(offs_m, NQ - 1)[:, None]
    q = load_rows(Qb, offs_m, sqm, NQ, D, offs_d)
    qn = sq_norms(QN + pid_bh * NQ, offs_m, NQ, KERNEL)
    KNb = KN + (b * (H // GROUP) + h // GROUP) * NK
    do = load_rows(DOb, offs_m, sdm, NQ, DVD, offs_v)
    lse = tl.load(LSE + pid_bh * NQ + offs_m, mask=offs_m < NQ, other=float("inf"))
    delta = tl.load(DELTA + pid_bh * NQ + offs_m, mask=offs_m < NQ, other=0.0)
    scale = tl.load(SCALE + h)
    row = TABLE + b * stb + h * sth + pid_m * stm
    n_partial = tl.load(row)
    n_full = tl.load(row + 1)
    dq = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    row_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    dscale = tl.zeros([BLOCK_M], dtype=tl.float32)
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else n_partial
        count = n_partial if phase == 0 else n_full
        first, consecutive = tile_run(row, lo, count)
        if phase == 1 and consecutive:  # full tiles, usually one run
            for j in range(0, count):
                dq, row_sum, dscale = _dq_tile(
                    first + j, dq, row_sum, dscale, q, qn, do, lse, delta, Qb, Kb, Vb, KNb, DQb,
                    offs_m, offs_d, offs_v, q_idx, scale, b, h, pid_bh, sqm, skn, svn, NQ, NK,
                    OFFSET, SEED, DROPOUT_P, A0, A1, A2, A3, AS, G0, G1, G2, G3, D, DVD, D_PAD,
                    BLOCK_M, BLOCK_N, BLOCK_D, KERNEL, phase == 0, HAS_MASK, MASK_FN, HAS_MOD,
                    MOD_FN, MOD_BWD_FN, MOD_GRAD, SCALE_GRAD, DROPOUT, PRECISION, TERM_FN,
                    TERM_DQ_FN, TERM_GRAD, TERM_GRAD_FN)
        else:
            for j in range(lo, lo + count):
                dq, row_sum, dscale = _dq_tile(
                    tl.load(row + 2 + j), dq, row_sum, dscale, q, qn, do, lse, delta, Qb, Kb, Vb,
                    KNb, DQb, offs_m, offs_d, offs_v, q_idx, scale, b, h, pid_bh, sqm, skn, svn,
                    NQ, NK, OFFSET, SEED, DROPOUT_P, A0, A1, A2, A3, AS, G0, G1, G2, G3, D,
                    DVD, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, KERNEL, phase == 0, HAS_MASK,
                    MASK_FN, HAS_MOD, MOD_FN, MOD_BWD_FN, MOD_GRAD, SCALE_GRAD, DROPOUT,
                    PRECISION, TERM_FN, TERM_DQ_FN, TERM_GRAD, TERM_GRAD_FN)
    keep = (offs_m[:, None] < NQ) & (offs_d[None, :] < D)
    if KERNEL < 2:  # stored once, in DQ's dtype (the chunked terms added into fp32 DQ)
        if KERNEL == 1:
            dq = 2.0 * dq - 2.0 * row_sum[:, None] * q.to(tl.float32)
        tl.store(DQb + offs_m[:, None] * D + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=keep)
    if SCALE_GRAD:
        tl.atomic_add(DSCALE + h, tl.sum(dscale, 0))
