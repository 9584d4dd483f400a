"""FlashAttention-2 style Triton kernels for every qkv variant: forward, dK/dV and dQ.

Each program owns one tile of rows and loops only over the tiles its block table lists:
first the PARTIAL ones (bounds and mask evaluated), then the FULL ones (no masking at all).
The variant is fixed at compile time through constexpr arguments:
- ``KERNEL``: the pairwise term on (features of) q and k: 0 dot (tensor cores),
  1 neg_sqdist (2q·k - ‖q‖² - ‖k‖² on tensor cores, norms in fp32), 2 neg_l1 (CUDA cores,
  D in chunks of BLOCK_D), 3 a term traced from its definition (``TERM_FN`` and its
  derivatives, generated like the score modifier's; CUDA cores, D in chunks of BLOCK_D);
- ``MASK_FN`` / ``MOD_FN`` / ``MOD_BWD_FN``: jit functions generated from the mask and score
  modifier definitions (see kernelgen/triton.py); they read the captured tensors A0..A3
  (strides AS).

Logits are kept in base 2 (scaled by log2 e) for exp2. The saved log-sum-exp LSE (B, H, Nq)
is base 2 too, and +inf for a row with no allowed key, so that its probabilities are 0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def noop_mask(b, h, q_idx, kv_idx, offset, A0, A1, A2, A3, AS):
    return q_idx >= 0


@triton.jit
def noop_mod(score, b, h, q_idx, kv_idx, offset, A0, A1, A2, A3, AS):
    return score


@triton.jit
def noop_mod_bwd(score, ds, valid, b, h, q_idx, kv_idx, offset, A0, A1, A2, A3, AS,
                  G0, G1, G2, G3, GRAD: tl.constexpr):
    return ds


@triton.jit
def noop_term(pq, pk, pd, A0, A1, A2, A3, AS):
    return pq * 0.0


@triton.jit
def noop_term_grad(pq, pk, pd, A0, A1, A2, A3, AS, dz, pd1, d_ok, G0, G1, G2, G3):
    pass


@triton.jit
def _load_rows(base, offs, stride, n, D: tl.constexpr, offs_d):
    """Rows ``offs`` (< n) of a (n, D) matrix, columns ``offs_d`` (< D), zero-padded."""
    return tl.load(base + offs[:, None] * stride + offs_d[None, :],
                   mask=(offs[:, None] < n) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _pair_scores(q, k, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, A0, A1, A2, A3, AS,
                 KERNEL: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 PRECISION: tl.constexpr, TERM_FN: tl.constexpr):
    """z (BLOCK_M, BLOCK_N) fp32. For neg_sqdist it is unclamped (callers clamp at 0)."""
    if KERNEL == 0:
        z = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    elif KERNEL == 1:
        qf = q.to(tl.float32)
        kf = k.to(tl.float32)
        z = 2.0 * tl.dot(q, tl.trans(k), input_precision=PRECISION)
        z = z - tl.sum(qf * qf, 1)[:, None] - tl.sum(kf * kf, 1)[None, :]
    elif KERNEL == 2:
        z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D_PAD, BLOCK_D):
            offs_c = d0 + tl.arange(0, BLOCK_D)
            qc = _load_rows(Qb, offs_m, sqm, NQ, D, offs_c).to(tl.float32)
            kc = _load_rows(Kb, offs_n, skn, NK, D, offs_c).to(tl.float32)
            z -= tl.sum(tl.abs(qc[:, None, :] - kc[None, :, :]), 2)
    else:
        tl.static_assert(KERNEL == 3, "unknown pairwise KERNEL id")
        z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D_PAD, BLOCK_D):
            offs_c = d0 + tl.arange(0, BLOCK_D)
            qc = _load_rows(Qb, offs_m, sqm, NQ, D, offs_c).to(tl.float32)
            kc = _load_rows(Kb, offs_n, skn, NK, D, offs_c).to(tl.float32)
            pd = tl.minimum(offs_c, D - 1)[None, None, :]
            t = TERM_FN(qc[:, None, :], kc[None, :, :], pd, A0, A1, A2, A3, AS)
            z += tl.sum(tl.where((offs_c < D)[None, None, :], t, 0.0), 2)
    return z


@triton.jit
def _logits(z, scale, b, h, q_idx, kv_idx, offs_n, NK, OFFSET, A0, A1, A2, A3, AS,
            KERNEL: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_MASK: tl.constexpr,
            MASK_FN: tl.constexpr, HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr):
    """Base-2 logits: mod(scale·z)·log2 e, -inf outside the mask (and beyond Nk)."""
    if KERNEL == 1:
        z = tl.minimum(z, 0.0)
    if HAS_MOD:
        s = MOD_FN(z * scale, b, h, q_idx, kv_idx, OFFSET, A0, A1, A2, A3, AS) * 1.4426950408889634
    else:
        s = z * (scale * 1.4426950408889634)  # log2(e): exp2 below
    if APPLY_MASK:
        allowed = (q_idx >= 0) & (offs_n[None, :] < NK)
        if HAS_MASK:
            allowed = allowed & MASK_FN(b, h, q_idx, kv_idx, OFFSET, A0, A1, A2, A3, AS)
        s = tl.where(allowed, s, float("-inf"))
    return s


@triton.jit
def _dropout_keep(seed, bh, offs_m, offs_n, NK, DROPOUT_P):
    """Dropout's keep mask for a tile: one Philox stream per (batch, query head), one draw per
    score, so the forward, both backward kernels and the weights kernel agree."""
    return tl.rand(seed + bh, offs_m[:, None] * NK + offs_n[None, :]) >= DROPOUT_P


@triton.jit
def _l1_grad_rows(dz, Xb, Yb, offs_x, offs_y, sx, sy, NX, NY, OUT, so, sign,
                  D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_D: tl.constexpr):
    """OUT[x] += sign · Σ_y dz[x, y] · sign(X[x] - Y[y]) for neg_l1, chunk by chunk over D
    (dz is (rows of X, rows of Y)); the program owns rows ``offs_x`` of OUT."""
    for d0 in range(0, D_PAD, BLOCK_D):
        offs_c = d0 + tl.arange(0, BLOCK_D)
        xc = _load_rows(Xb, offs_x, sx, NX, D, offs_c).to(tl.float32)
        yc = _load_rows(Yb, offs_y, sy, NY, D, offs_c).to(tl.float32)
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
        qc = _load_rows(Qb, offs_m, sqm, NQ, D, offs_c).to(tl.float32)[:, None, :]
        kc = _load_rows(Kb, offs_n, skn, NK, D, offs_c).to(tl.float32)[None, :, :]
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
def fwd_kernel(
    Q, K, V, O, LSE, SCALE, TABLE, A0, A1, A2, A3, AS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, stb, sth, stm,
    H, NQ, NK, OFFSET, SEED, DROPOUT_P,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KERNEL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_FN: tl.constexpr,
    HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    TERM_FN: tl.constexpr,
):
    """Grid (ceil(Nq / BLOCK_M), B·H). Writes O (B, H, Nq, Dv) and base-2 LSE (B, H, Nq)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    Qb = Q + b * sqb + h * sqh
    Kb = K + b * skb + (h // GROUP) * skh
    Vb = V + b * svb + (h // GROUP) * svh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    offs_v = tl.arange(0, DV_PAD)
    q_idx = tl.minimum(offs_m, NQ - 1)[:, None]
    q = _load_rows(Qb, offs_m, sqm, NQ, D, offs_d)
    scale = tl.load(SCALE + h)
    row = TABLE + b * stb + h * sth + pid_m * stm
    n_partial = tl.load(row)
    n_full = tl.load(row + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else n_partial
        hi = n_partial if phase == 0 else n_partial + n_full
        for j in range(lo, hi):
            offs_n = tl.load(row + 2 + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_idx = tl.minimum(offs_n, NK - 1)[None, :]
            k = q
            if KERNEL < 2:  # the other terms load D in chunks
                k = _load_rows(Kb, offs_n, skn, NK, D, offs_d)
            v = _load_rows(Vb, offs_n, svn, NK, DV, offs_v)
            z = _pair_scores(q, k, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, A0, A1, A2, A3, AS,
                             KERNEL, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, TERM_FN)
            s = _logits(z, scale, b, h, q_idx, kv_idx, offs_n, NK, OFFSET, A0, A1, A2, A3, AS,
                        KERNEL, phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            if DROPOUT:
                keep = _dropout_keep(SEED, pid_bh, offs_m, offs_n, NK, DROPOUT_P)
                p = tl.where(keep, p / (1.0 - DROPOUT_P), 0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    keep = (offs_m[:, None] < NQ) & (offs_v[None, :] < DV)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_v[None, :],
             out.to(O.dtype.element_ty), mask=keep)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + pid_bh * NQ + offs_m, lse, mask=offs_m < NQ)


@triton.jit
def bwd_kv_kernel(
    Q, K, V, DO, LSE, DELTA, SCALE, TABLE, DK, DV, A0, A1, A2, A3, AS,
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
    kv_idx = tl.minimum(offs_n, NK - 1)[None, :]
    k = _load_rows(Kb, offs_n, skn, NK, D, offs_d)
    v = _load_rows(Vb, offs_n, svn, NK, DVD, offs_v)
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
            hi = n_partial if phase == 0 else n_partial + n_full
            for j in range(lo, hi):
                offs_m = tl.load(col + 2 + j) * BLOCK_M + tl.arange(0, BLOCK_M)
                q_idx = tl.minimum(offs_m, NQ - 1)[:, None]
                q = _load_rows(Qb, offs_m, sqm, NQ, D, offs_d)
                do = _load_rows(DOb, offs_m, sdm, NQ, DVD, offs_v)
                lse = tl.load(LSE + (b * H + h) * NQ + offs_m, mask=offs_m < NQ, other=float("inf"))
                delta = tl.load(DELTA + (b * H + h) * NQ + offs_m, mask=offs_m < NQ, other=0.0)
                z = _pair_scores(q, k, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, A0, A1, A2, A3,
                                 AS, KERNEL, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION,
                                 TERM_FN)
                s = _logits(z, scale, b, h, q_idx, kv_idx, offs_n, NK, OFFSET, A0, A1, A2, A3,
                            AS, KERNEL, phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN)
                p = tl.exp2(s - lse[:, None])
                dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
                if DROPOUT:
                    keep = _dropout_keep(SEED, b * H + h, offs_m, offs_n, NK, DROPOUT_P)
                    p_kept = tl.where(keep, p / (1.0 - DROPOUT_P), 0.0)
                    dv += tl.dot(tl.trans(p_kept.to(do.dtype)), do, input_precision=PRECISION)
                    dp = tl.where(keep, dp / (1.0 - DROPOUT_P), 0.0)
                else:
                    dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
                ds = p * (dp - delta[:, None])
                if HAS_MOD:
                    zc = tl.minimum(z, 0.0) if KERNEL == 1 else z
                    ds = MOD_BWD_FN(zc * scale, ds, p > 0.0, b, h, q_idx, kv_idx, OFFSET,
                                    A0, A1, A2, A3, AS, AS, AS, AS, AS, False)
                dz = ds * scale
                if KERNEL == 1:
                    dz = tl.where(z <= 0.0, dz, 0.0)
                if KERNEL == 2:
                    _l1_grad_rows(tl.trans(dz), Kb, Qb, offs_n, offs_m, skn, sqm, NK, NQ, DKb, D,
                                  -1.0, D, D_PAD, BLOCK_D)
                elif KERNEL == 3:
                    _term_grad_rows(dz, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, DKb, A0, A1,
                                    A2, A3, AS, AS, AS, AS, AS, D, D_PAD, BLOCK_D, True,
                                    TERM_DK_FN, False, TERM_GRAD_FN)
                else:
                    dk += tl.dot(tl.trans(dz.to(q.dtype)), q, input_precision=PRECISION)
                    col_sum += tl.sum(dz, 0)
    keep = offs_n[:, None] < NK
    if KERNEL == 0:
        tl.store(DKb + offs_n[:, None] * D + offs_d[None, :], dk, mask=keep & (offs_d[None, :] < D))
    if KERNEL == 1:
        dk = 2.0 * dk - 2.0 * col_sum[:, None] * k.to(tl.float32)
        tl.store(DKb + offs_n[:, None] * D + offs_d[None, :], dk, mask=keep & (offs_d[None, :] < D))
    tl.store(DV + pid_bh * NK * DVD + offs_n[:, None] * DVD + offs_v[None, :], dv,
             mask=keep & (offs_v[None, :] < DVD))


@triton.jit
def bwd_q_kernel(
    Q, K, V, DO, LSE, DELTA, SCALE, TABLE, DQ, DSCALE, A0, A1, A2, A3, AS, G0, G1, G2, G3,
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
    q = _load_rows(Qb, offs_m, sqm, NQ, D, offs_d)
    do = _load_rows(DOb, offs_m, sdm, NQ, DVD, offs_v)
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
        hi = n_partial if phase == 0 else n_partial + n_full
        for j in range(lo, hi):
            offs_n = tl.load(row + 2 + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_idx = tl.minimum(offs_n, NK - 1)[None, :]
            k = q
            if KERNEL < 2:  # the other terms load D in chunks
                k = _load_rows(Kb, offs_n, skn, NK, D, offs_d)
            v = _load_rows(Vb, offs_n, svn, NK, DVD, offs_v)
            z = _pair_scores(q, k, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, A0, A1, A2, A3, AS,
                             KERNEL, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, TERM_FN)
            s = _logits(z, scale, b, h, q_idx, kv_idx, offs_n, NK, OFFSET, A0, A1, A2, A3, AS,
                        KERNEL, phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN)
            p = tl.exp2(s - lse[:, None])
            dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
            if DROPOUT:
                keep = _dropout_keep(SEED, pid_bh, offs_m, offs_n, NK, DROPOUT_P)
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
    keep = (offs_m[:, None] < NQ) & (offs_d[None, :] < D)
    if KERNEL == 0:
        tl.store(DQb + offs_m[:, None] * D + offs_d[None, :], dq, mask=keep)
    if KERNEL == 1:
        dq = 2.0 * dq - 2.0 * row_sum[:, None] * q.to(tl.float32)
        tl.store(DQb + offs_m[:, None] * D + offs_d[None, :], dq, mask=keep)
    if SCALE_GRAD:
        tl.atomic_add(DSCALE + h, tl.sum(dscale, 0))



@triton.jit
def weights_kernel(
    Q, K, W, LSE, SCALE, TABLE, A0, A1, A2, A3, AS,
    sqb, sqh, sqm, skb, skh, skn, swb, swh, swm, stb, sth, stm,
    H, NQ, NK, OFFSET, SEED, DROPOUT_P,
    GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KERNEL: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_FN: tl.constexpr, HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, TERM_FN: tl.constexpr,
):
    """Grid (ceil(Nq / BLOCK_M), B·H): the attention weights W (B, H, Nq, Nk) recomputed from
    the forward's LSE on every listed tile; unlisted (empty) tiles keep W's zeros."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // H
    h = pid_bh % H
    Qb = Q + b * sqb + h * sqh
    Kb = K + b * skb + (h // GROUP) * skh
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    q_idx = tl.minimum(offs_m, NQ - 1)[:, None]
    q = _load_rows(Qb, offs_m, sqm, NQ, D, offs_d)
    lse = tl.load(LSE + pid_bh * NQ + offs_m, mask=offs_m < NQ, other=float("inf"))
    scale = tl.load(SCALE + h)
    row = TABLE + b * stb + h * sth + pid_m * stm
    n_partial = tl.load(row)
    n_full = tl.load(row + 1)
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else n_partial
        hi = n_partial if phase == 0 else n_partial + n_full
        for j in range(lo, hi):
            offs_n = tl.load(row + 2 + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            kv_idx = tl.minimum(offs_n, NK - 1)[None, :]
            k = q
            if KERNEL < 2:  # the other terms load D in chunks
                k = _load_rows(Kb, offs_n, skn, NK, D, offs_d)
            z = _pair_scores(q, k, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, A0, A1, A2, A3, AS,
                             KERNEL, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, TERM_FN)
            s = _logits(z, scale, b, h, q_idx, kv_idx, offs_n, NK, OFFSET, A0, A1, A2, A3, AS,
                        KERNEL, phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN)
            p = tl.exp2(s - lse[:, None])
            if DROPOUT:
                kept = _dropout_keep(SEED, pid_bh, offs_m, offs_n, NK, DROPOUT_P)
                p = tl.where(kept, p / (1.0 - DROPOUT_P), 0.0)
            inside = (offs_m[:, None] < NQ) & (offs_n[None, :] < NK)
            tl.store(W + b * swb + h * swh + offs_m[:, None] * swm + offs_n[None, :],
                     p.to(W.dtype.element_ty), mask=inside)
