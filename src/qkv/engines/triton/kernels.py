"""FlashAttention-2 style Triton kernels for every qkv variant: the forward, the weights, and
what they share with the backward kernels (``backward.py``).

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
def load_rows(base, offs, stride, n, D: tl.constexpr, offs_d):
    """Rows ``offs`` (< n) of a (n, D) matrix, columns ``offs_d`` (< D), zero-padded."""
    return tl.load(base + offs[:, None] * stride + offs_d[None, :],
                   mask=(offs[:, None] < n) & (offs_d[None, :] < D), other=0.0)


@triton.jit
def load_key_rows(base, offs, stride, n, D: tl.constexpr, offs_d, MASKED: tl.constexpr):
    """``load_rows`` for a key tile. An unmasked tile (FULL: never the ragged last one) lies
    inside the matrix, so only the padded columns are masked, a constant of the loop."""
    if MASKED:
        x = load_rows(base, offs, stride, n, D, offs_d)
    else:
        x = tl.load(base + offs[:, None] * stride + offs_d[None, :],
                    mask=(offs_d < D)[None, :], other=0.0)
    return x


@triton.jit
def row_dots_kernel(X, Y, OUT, sxb, sxh, sxn, syb, syh, syn, H, N, D: tl.constexpr,
                    D_PAD: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (ceil(N / BLOCK), B·H): OUT (B, H, N) fp32 = Σ_d X[b, h, n, d]·Y[b, h, n, d],
    summed in fp32: squared norms (Y = X) for neg_sqdist, and the backward's
    delta = rowsum(dO ∘ O)."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = tl.arange(0, D_PAD)
    x = load_rows(X + b * sxb + h * sxh, rows, sxn, N, D, offs).to(tl.float32)
    y = load_rows(Y + b * syb + h * syh, rows, syn, N, D, offs).to(tl.float32)
    tl.store(OUT + pid_bh * N + rows, tl.sum(x * y, 1), mask=rows < N)


@triton.jit
def sq_norms(NORMS, offs, n, KERNEL: tl.constexpr):
    """‖x‖² of rows ``offs`` (< n) from row_dots_kernel's output for neg_sqdist; unused zeros
    (nothing loaded) for the other kernels."""
    norms = offs.to(tl.float32) * 0.0
    if KERNEL == 1:
        norms = tl.load(NORMS + offs, mask=offs < n, other=0.0)
    return norms


@triton.jit
def pair_scores(q, k, qn, kn, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, A0, A1, A2, A3, AS,
                KERNEL: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                PRECISION: tl.constexpr, TERM_FN: tl.constexpr):
    """z (BLOCK_M, BLOCK_N) fp32. neg_sqdist reads the squared norms qn (BLOCK_M,) and kn
    (BLOCK_N,), computed once per call (per tile they doubled the backward's instructions),
    and is unclamped (callers clamp at 0)."""
    if KERNEL == 0:
        z = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    elif KERNEL == 1:
        z = 2.0 * tl.dot(q, tl.trans(k), input_precision=PRECISION)
        z = z - qn[:, None] - kn[None, :]
    elif KERNEL == 2:
        z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D_PAD, BLOCK_D):
            offs_c = d0 + tl.arange(0, BLOCK_D)
            qc = load_rows(Qb, offs_m, sqm, NQ, D, offs_c).to(tl.float32)
            kc = load_rows(Kb, offs_n, skn, NK, D, offs_c).to(tl.float32)
            z -= tl.sum(tl.abs(qc[:, None, :] - kc[None, :, :]), 2)
    else:
        tl.static_assert(KERNEL == 3, "unknown pairwise KERNEL id")
        z = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for d0 in range(0, D_PAD, BLOCK_D):
            offs_c = d0 + tl.arange(0, BLOCK_D)
            qc = load_rows(Qb, offs_m, sqm, NQ, D, offs_c).to(tl.float32)
            kc = load_rows(Kb, offs_n, skn, NK, D, offs_c).to(tl.float32)
            pd = tl.minimum(offs_c, D - 1)[None, None, :]
            t = TERM_FN(qc[:, None, :], kc[None, :, :], pd, A0, A1, A2, A3, AS)
            z += tl.sum(tl.where((offs_c < D)[None, None, :], t, 0.0), 2)
    return z


@triton.jit
def logits(z, scale, b, h, q_idx, kv_idx, key_ok, OFFSET, A0, A1, A2, A3, AS,
           KERNEL: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_MASK: tl.constexpr,
           MASK_FN: tl.constexpr, HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr):
    """Base-2 logits: mod(scale·z)·log2 e, -inf outside the mask and where ``key_ok`` (keys
    < Nk) is False. The indices broadcast against z: (m, 1) and (1, n), or transposed."""
    if KERNEL == 1:
        z = tl.minimum(z, 0.0)
    if HAS_MOD:
        s = MOD_FN(z * scale, b, h, q_idx, kv_idx, OFFSET, A0, A1, A2, A3, AS) * 1.4426950408889634
    else:
        s = z * (scale * 1.4426950408889634)  # log2(e): exp2 below
    if APPLY_MASK:
        allowed = key_ok  # tl.where broadcasts it (and the rule's result) against s
        if HAS_MASK:
            allowed = allowed & MASK_FN(b, h, q_idx, kv_idx, OFFSET, A0, A1, A2, A3, AS)
        s = tl.where(allowed, s, float("-inf"))
    return s


@triton.jit
def dropout_keep(seed, bh, rows, keys, NK, DROPOUT_P):
    """Dropout's keep mask for a tile of query ``rows`` and ``keys`` (broadcastable index
    tensors, either way round): one Philox stream per (batch, query head), one draw per score,
    so the forward, both backward kernels and the weights kernel agree."""
    return tl.rand(seed + bh, rows * NK + keys) >= DROPOUT_P


@triton.jit
def tile_run(table_row, lo, count):
    """The first of the ``count`` tiles listed from ``lo`` in a block-table row, and whether
    they are consecutive. A consecutive run is counted, not looked up: with the index loaded
    from the table inside the loop, Triton's pipeliner waits for every copy before each tile
    (cp.async.wait_group 0 in the PTX) instead of keeping a stage in flight."""
    first = tl.load(table_row + 2 + lo, mask=count > 0, other=0)
    last = tl.load(table_row + 1 + lo + count, mask=count > 0, other=0)
    return first, last - first == count - 1


@triton.jit
def key_logits(offs_n, q, qn, Qb, Kb, KNb, offs_m, offs_d, q_idx, scale, b, h, sqm, skn, NQ, NK,
               OFFSET, A0, A1, A2, A3, AS, D: tl.constexpr, D_PAD: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
               KERNEL: tl.constexpr, APPLY_MASK: tl.constexpr, HAS_MASK: tl.constexpr,
               MASK_FN: tl.constexpr, HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr,
               PRECISION: tl.constexpr, TERM_FN: tl.constexpr):
    """The keys ``offs_n`` against a program's query rows: kv_idx, k (for the chunked terms,
    q: they load D in chunks), the pair scores z and the base-2 logits s. ``qn``: the query
    rows' squared norms; ``KNb``: the key head's (both for neg_sqdist)."""
    kv_idx = tl.minimum(offs_n, NK - 1)[None, :]
    k = q
    if KERNEL < 2:
        k = load_key_rows(Kb, offs_n, skn, NK, D, offs_d, APPLY_MASK)
    kn = sq_norms(KNb, offs_n, NK, KERNEL)
    z = pair_scores(q, k, qn, kn, Qb, Kb, offs_m, offs_n, sqm, skn, NQ, NK, A0, A1, A2, A3, AS,
                    KERNEL, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, TERM_FN)
    s = logits(z, scale, b, h, q_idx, kv_idx, offs_n[None, :] < NK, OFFSET, A0, A1, A2, A3, AS,
               KERNEL, APPLY_MASK, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN)
    return kv_idx, k, z, s


@triton.jit
def key_tile(tile, q, qn, Qb, Kb, Vb, KNb, offs_m, offs_d, offs_v, q_idx, scale, b, h, sqm, skn,
             svn, NQ, NK, OFFSET, A0, A1, A2, A3, AS, D: tl.constexpr, DV: tl.constexpr,
             D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_D: tl.constexpr, KERNEL: tl.constexpr, APPLY_MASK: tl.constexpr,
             HAS_MASK: tl.constexpr, MASK_FN: tl.constexpr, HAS_MOD: tl.constexpr,
             MOD_FN: tl.constexpr, PRECISION: tl.constexpr, TERM_FN: tl.constexpr):
    """Key tile ``tile`` against a program's query rows: its offsets, v (loaded first, as
    before the scores) and ``key_logits``."""
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    v = load_key_rows(Vb, offs_n, svn, NK, DV, offs_v, APPLY_MASK)
    kv_idx, k, z, s = key_logits(
        offs_n, q, qn, Qb, Kb, KNb, offs_m, offs_d, q_idx, scale, b, h, sqm, skn, NQ, NK, OFFSET,
        A0, A1, A2, A3, AS, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, KERNEL, APPLY_MASK, HAS_MASK,
        MASK_FN, HAS_MOD, MOD_FN, PRECISION, TERM_FN)
    return offs_n, kv_idx, k, v, z, s


@triton.jit
def _fwd_tile(tile, m_i, l_i, acc, q, qn, Qb, Kb, Vb, KNb, offs_m, offs_d, offs_v, q_idx, scale,
              b, h, pid_bh, sqm, skn, svn, NQ, NK, OFFSET, SEED, DROPOUT_P, A0, A1, A2, A3, AS,
              D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, KERNEL: tl.constexpr,
              APPLY_MASK: tl.constexpr, HAS_MASK: tl.constexpr, MASK_FN: tl.constexpr,
              HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr, DROPOUT: tl.constexpr,
              PRECISION: tl.constexpr, TERM_FN: tl.constexpr):
    """One key tile of the forward's online softmax: (m_i, l_i, acc) updated."""
    offs_n, kv_idx, k, v, z, s = key_tile(
        tile, q, qn, Qb, Kb, Vb, KNb, offs_m, offs_d, offs_v, q_idx, scale, b, h, sqm, skn, svn,
        NQ, NK, OFFSET, A0, A1, A2, A3, AS, D, DV, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, KERNEL,
        APPLY_MASK, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN, PRECISION, TERM_FN)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:
        keep = dropout_keep(SEED, pid_bh, offs_m[:, None], offs_n[None, :], NK, DROPOUT_P)
        p = tl.where(keep, p / (1.0 - DROPOUT_P), 0.0)
    # rescaled before the product, which accumulates into it (no separate sum)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def fwd_kernel(
    Q, K, V, O, LSE, SCALE, TABLE, QN, KN, A0, A1, A2, A3, AS,
    sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som, stb, sth, stm,
    H, NQ, NK, OFFSET, SEED, DROPOUT_P,
    GROUP: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, D_PAD: tl.constexpr,
    DV_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    KERNEL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_FN: tl.constexpr,
    HAS_MOD: tl.constexpr, MOD_FN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    TERM_FN: tl.constexpr,
):
    """Grid (ceil(Nq / BLOCK_M), B·H). Writes O (B, H, Nq, Dv) and base-2 LSE (B, H, Nq).
    QN (B, H, Nq) and KN (B, Hkv, Nk): the features' squared norms (read for neg_sqdist)."""
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
    q = load_rows(Qb, offs_m, sqm, NQ, D, offs_d)
    qn = sq_norms(QN + pid_bh * NQ, offs_m, NQ, KERNEL)
    KNb = KN + (b * (H // GROUP) + h // GROUP) * NK
    scale = tl.load(SCALE + h)
    row = TABLE + b * stb + h * sth + pid_m * stm
    n_partial = tl.load(row)
    n_full = tl.load(row + 1)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], dtype=tl.float32)
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else n_partial
        count = n_partial if phase == 0 else n_full
        first, consecutive = tile_run(row, lo, count)
        if phase == 1 and consecutive:  # full tiles, usually one run
            for j in range(0, count):
                m_i, l_i, acc = _fwd_tile(
                    first + j, m_i, l_i, acc, q, qn, Qb, Kb, Vb, KNb, offs_m, offs_d, offs_v,
                    q_idx, scale, b, h, pid_bh, sqm, skn, svn, NQ, NK, OFFSET, SEED, DROPOUT_P,
                    A0, A1, A2, A3, AS, D, DV, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, KERNEL,
                    phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN, DROPOUT, PRECISION, TERM_FN)
        else:
            for j in range(lo, lo + count):
                m_i, l_i, acc = _fwd_tile(
                    tl.load(row + 2 + j), m_i, l_i, acc, q, qn, Qb, Kb, Vb, KNb, offs_m, offs_d,
                    offs_v, q_idx, scale, b, h, pid_bh, sqm, skn, svn, NQ, NK, OFFSET, SEED,
                    DROPOUT_P, A0, A1, A2, A3, AS, D, DV, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D,
                    KERNEL, phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN, DROPOUT, PRECISION,
                    TERM_FN)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    keep = (offs_m[:, None] < NQ) & (offs_v[None, :] < DV)
    tl.store(O + b * sob + h * soh + offs_m[:, None] * som + offs_v[None, :],
             out.to(O.dtype.element_ty), mask=keep)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + pid_bh * NQ + offs_m, lse, mask=offs_m < NQ)


@triton.jit
def weights_kernel(
    Q, K, W, LSE, SCALE, TABLE, QN, KN, A0, A1, A2, A3, AS,
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
    q = load_rows(Qb, offs_m, sqm, NQ, D, offs_d)
    lse = tl.load(LSE + pid_bh * NQ + offs_m, mask=offs_m < NQ, other=float("inf"))
    qn = sq_norms(QN + pid_bh * NQ, offs_m, NQ, KERNEL)
    KNb = KN + (b * (H // GROUP) + h // GROUP) * NK
    scale = tl.load(SCALE + h)
    row = TABLE + b * stb + h * sth + pid_m * stm
    n_partial = tl.load(row)
    n_full = tl.load(row + 1)
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else n_partial
        hi = n_partial if phase == 0 else n_partial + n_full
        for j in range(lo, hi):
            offs_n = tl.load(row + 2 + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            _, _, _, s = key_logits(
                offs_n, q, qn, Qb, Kb, KNb, offs_m, offs_d, q_idx, scale, b, h, sqm, skn, NQ,
                NK, OFFSET, A0, A1, A2, A3, AS, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_D, KERNEL,
                phase == 0, HAS_MASK, MASK_FN, HAS_MOD, MOD_FN, PRECISION, TERM_FN)
            p = tl.exp2(s - lse[:, None])
            if DROPOUT:
                kept = dropout_keep(SEED, pid_bh, offs_m[:, None], offs_n[None, :], NK,
                                    DROPOUT_P)
                p = tl.where(kept, p / (1.0 - DROPOUT_P), 0.0)
            inside = (offs_m[:, None] < NQ) & (offs_n[None, :] < NK)
            tl.store(W + b * swb + h * swh + offs_m[:, None] * swm + offs_n[None, :],
                     p.to(W.dtype.element_ty), mask=inside)
