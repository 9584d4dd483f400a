"""FlashAttention-2 style Triton kernels for every qkv variant: the forward, the weights, and
what they share with the backward kernels (``backward.py``).

Each program owns one tile of rows and visits only the tiles its block table lists
(``visit_tiles``): first the PARTIAL ones (bounds and mask evaluated), then the FULL ones (no
masking at all). A kernel's arguments come in groups (``groups.py``): tensors with their
strides (``Mat``), the call's sizes (``Sizes``), the captured tensors (``SLOTS``), and two
groups of compile-time constants: the tiling (``Shape``) and what the variant computes
(``Code``):
- ``C.KIND``: the pairwise term on (features of) q and k, a ``TermKind``: DOT (tensor cores),
  SQDIST (2q·k - ‖q‖² - ‖k‖² on tensor cores, norms in fp32), L1 (CUDA cores, D in chunks of
  BLOCK_D), TRACED (``TERM_FN`` and its derivatives, generated from the term's definition like
  the score modifier's; CUDA cores, D in chunks of BLOCK_D);
- ``MASK_FN`` / ``MOD_FN`` / ``MOD_BWD_FN``: jit functions generated from the mask and score
  modifier definitions (see kernelgen/triton.py); they read the captured tensors SLOTS.

Triton keeps a constant read from a group a constant only where it is used as read
(``T.BLOCK_M``): copied into a local name, it becomes a run-time value. So the kernels always
write ``T.`` and ``C.`` in full, and pass the groups down whole.

Logits are kept in base 2 (scaled by log2 e) for exp2. The saved log-sum-exp LSE (B, H, Nq)
is base 2 too, and +inf for a row with no allowed key, so that its probabilities are 0.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .groups import DOT, L1, SQDIST, TRACED, QueryRows


@triton.jit
def noop_mask(b, h, q_idx, kv_idx, offset, SLOTS):
    return q_idx >= 0


@triton.jit
def noop_mod(score, b, h, q_idx, kv_idx, offset, SLOTS):
    return score


@triton.jit
def noop_mod_bwd(score, ds, valid, b, h, q_idx, kv_idx, offset, SLOTS, GRADS, GRAD: tl.constexpr):
    return ds


@triton.jit
def noop_term(pq, pk, pd, SLOTS):
    return pq * 0.0


@triton.jit
def noop_term_grad(pq, pk, pd, SLOTS, dz, pd1, d_ok, GRADS):
    pass


@triton.jit
def head_of(M, b, h):
    """The (b, h) matrix of a ``Mat``."""
    return M.ptr + b * M.sb + h * M.sh


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
def load_chunk(rows, offs_c, D: tl.constexpr):
    """Columns ``offs_c`` of the rows ``rows`` = (base, offsets, row stride, count) in fp32."""
    return load_rows(rows[0], rows[1], rows[2], rows[3], D, offs_c).to(tl.float32)


@triton.jit
def row_dots_kernel(X, Y, OUT, H, N, D: tl.constexpr, D_PAD: tl.constexpr,
                    BLOCK: tl.constexpr):
    """Grid (ceil(N / BLOCK), B·H): OUT (B, H, N) fp32 = Σ_d X[b, h, n, d]·Y[b, h, n, d] of
    the ``Mat``s X and Y, summed in fp32: squared norms (Y = X) for SQDIST, and the
    backward's delta = rowsum(dO ∘ O)."""
    pid_bh = tl.program_id(1)
    b, h = pid_bh // H, pid_bh % H
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = tl.arange(0, D_PAD)
    x = load_rows(head_of(X, b, h), rows, X.sm, N, D, offs).to(tl.float32)
    y = load_rows(head_of(Y, b, h), rows, Y.sm, N, D, offs).to(tl.float32)
    tl.store(OUT + pid_bh * N + rows, tl.sum(x * y, 1), mask=rows < N)


@triton.jit
def sq_norms(NORMS, offs, n, KIND: tl.constexpr):
    """‖x‖² of rows ``offs`` (< n) from row_dots_kernel's output for SQDIST; unused zeros
    (nothing loaded) for the other terms."""
    norms = offs.to(tl.float32) * 0.0
    if KIND == SQDIST:
        norms = tl.load(NORMS + offs, mask=offs < n, other=0.0)
    return norms


@triton.jit
def pair_scores(q, k, qn, kn, QR, KR, SLOTS, T, C):
    """z (BLOCK_M, BLOCK_N) fp32 of query rows QR and key rows KR (each (base, offsets, row
    stride, count): the chunked terms load D in chunks; the product terms take the tiles q
    and k). SQDIST reads the squared norms qn (BLOCK_M,) and kn (BLOCK_N,), computed once per
    call rather than per tile, and is unclamped (callers clamp at 0)."""
    if C.KIND == DOT:
        z = tl.dot(q, tl.trans(k), input_precision=T.PRECISION)
    elif C.KIND == SQDIST:
        z = 2.0 * tl.dot(q, tl.trans(k), input_precision=T.PRECISION)
        z = z - qn[:, None] - kn[None, :]
    elif C.KIND == L1:
        z = tl.zeros([T.BLOCK_M, T.BLOCK_N], dtype=tl.float32)
        for d0 in range(0, T.D_PAD, T.BLOCK_D):
            offs_c = d0 + tl.arange(0, T.BLOCK_D)
            qc = load_chunk(QR, offs_c, T.D)
            kc = load_chunk(KR, offs_c, T.D)
            z -= tl.sum(tl.abs(qc[:, None, :] - kc[None, :, :]), 2)
    else:
        tl.static_assert(C.KIND == TRACED, "unknown pairwise term kind")
        z = tl.zeros([T.BLOCK_M, T.BLOCK_N], dtype=tl.float32)
        for d0 in range(0, T.D_PAD, T.BLOCK_D):
            offs_c = d0 + tl.arange(0, T.BLOCK_D)
            qc = load_chunk(QR, offs_c, T.D)
            kc = load_chunk(KR, offs_c, T.D)
            pd = tl.minimum(offs_c, T.D - 1)[None, None, :]
            t = C.TERM_FN(qc[:, None, :], kc[None, :, :], pd, SLOTS)
            z += tl.sum(tl.where((offs_c < T.D)[None, None, :], t, 0.0), 2)
    return z


@triton.jit
def logits(z, scale, b, h, q_idx, kv_idx, key_ok, OFFSET, SLOTS, C, APPLY_MASK: tl.constexpr):
    """Base-2 logits: mod(scale·z)·log2 e, -inf outside the mask and where ``key_ok`` (keys
    < Nk) is False. The indices broadcast against z: (m, 1) and (1, n), or transposed."""
    if C.KIND == SQDIST:
        z = tl.minimum(z, 0.0)
    if C.HAS_MOD:
        s = C.MOD_FN(z * scale, b, h, q_idx, kv_idx, OFFSET, SLOTS) * 1.4426950408889634
    else:
        s = z * (scale * 1.4426950408889634)  # log2(e): exp2 below
    if APPLY_MASK:
        allowed = key_ok  # tl.where broadcasts it (and the rule's result) against s
        if C.HAS_MASK:
            allowed = allowed & C.MASK_FN(b, h, q_idx, kv_idx, OFFSET, SLOTS)
        s = tl.where(allowed, s, float("-inf"))
    return s


@triton.jit
def dropout_keep(S, bh, rows, keys):
    """Dropout's keep mask for a tile of query ``rows`` and ``keys`` (broadcastable index
    tensors, either way round): one Philox stream per (batch, query head), one draw per score,
    so the forward, both backward kernels and the weights kernel agree."""
    return tl.rand(S.SEED + bh, rows * S.NK + keys) >= S.DROPOUT_P


@triton.jit
def query_rows(Q, K, V, NORMS, SCALE, S, T, C):
    """The query tile of this program (grid (ceil(Nq / BLOCK_M), B·H)) as a ``QueryRows``."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = pid_bh // S.H
    h = pid_bh % S.H
    Qb = head_of(Q, b, h)
    offs_m = pid_m * T.BLOCK_M + tl.arange(0, T.BLOCK_M)
    offs_d = tl.arange(0, T.D_PAD)
    return QueryRows(
        q=load_rows(Qb, offs_m, Q.sm, S.NQ, T.D, offs_d),
        qn=sq_norms(NORMS[0] + pid_bh * S.NQ, offs_m, S.NQ, C.KIND),
        Qb=Qb, Kb=head_of(K, b, h // T.GROUP), Vb=head_of(V, b, h // T.GROUP),
        KNb=NORMS[1] + (b * (S.H // T.GROUP) + h // T.GROUP) * S.NK,
        offs_m=offs_m, offs_d=offs_d, offs_v=tl.arange(0, T.DV_PAD),
        q_idx=tl.minimum(offs_m, S.NQ - 1)[:, None], scale=tl.load(SCALE + h), b=b, h=h,
        pid_bh=pid_bh, sqm=Q.sm, skn=K.sm, svn=V.sm,
    )


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
def tile_loop(table_row, first, lo, hi, LOOKUP: tl.constexpr, state, TILE: tl.constexpr, R, X,
              SLOTS, S, T, C, MASKED: tl.constexpr):
    """``state`` through TILE(tile, state, R, X, SLOTS, S, T, C, MASKED) for the tiles of
    positions lo..hi-1 of a block-table row: looked up (LOOKUP) or counted from ``first``."""
    for j in range(lo, hi):
        tile = tl.load(table_row + 2 + j) if LOOKUP else first + j
        state = TILE(tile, state, R, X, SLOTS, S, T, C, MASKED)
    return state


@triton.jit
def visit_tiles(table_row, state, TILE: tl.constexpr, R, X, SLOTS, S, T, C):
    """``state`` through TILE for every tile a block-table row lists: its partial tiles
    (masked), then its full ones (counted when consecutive, as they usually are). R: the
    program's own rows; X: what TILE needs besides (None if nothing)."""
    n_partial = tl.load(table_row)
    n_full = tl.load(table_row + 1)
    for phase in tl.static_range(2):
        lo = 0 if phase == 0 else n_partial
        count = n_partial if phase == 0 else n_full
        first, consecutive = tile_run(table_row, lo, count)
        if phase == 1 and consecutive:
            state = tile_loop(table_row, first, 0, count, False, state, TILE, R, X, SLOTS, S,
                              T, C, False)
        else:
            state = tile_loop(table_row, first, lo, lo + count, True, state, TILE, R, X, SLOTS,
                              S, T, C, phase == 0)
    return state


@triton.jit
def table_row(TABLE, b, h, i):
    """Row ``i`` of the (b, h) block table."""
    return head_of(TABLE, b, h) + i * TABLE.sm


@triton.jit
def key_logits(offs_n, R, SLOTS, S, T, C, APPLY_MASK: tl.constexpr):
    """The keys ``offs_n`` against a program's query rows R: kv_idx, k (for the chunked
    terms, R.q: they load D in chunks), the pair scores z and the base-2 logits s."""
    kv_idx = tl.minimum(offs_n, S.NK - 1)[None, :]
    k = R.q
    if C.PRODUCTS:
        k = load_key_rows(R.Kb, offs_n, R.skn, S.NK, T.D, R.offs_d, APPLY_MASK)
    kn = sq_norms(R.KNb, offs_n, S.NK, C.KIND)
    z = pair_scores(R.q, k, R.qn, kn, (R.Qb, R.offs_m, R.sqm, S.NQ), (R.Kb, offs_n, R.skn, S.NK),
                    SLOTS, T, C)
    s = logits(z, R.scale, R.b, R.h, R.q_idx, kv_idx, offs_n[None, :] < S.NK, S.OFFSET, SLOTS, C,
               APPLY_MASK)
    return kv_idx, k, z, s


@triton.jit
def key_tile(tile, R, SLOTS, S, T, C, APPLY_MASK: tl.constexpr):
    """Key tile ``tile`` against a program's query rows: its offsets, v (loaded first, as
    before the scores) and ``key_logits``."""
    offs_n = tile * T.BLOCK_N + tl.arange(0, T.BLOCK_N)
    v = load_key_rows(R.Vb, offs_n, R.svn, S.NK, T.DV, R.offs_v, APPLY_MASK)
    kv_idx, k, z, s = key_logits(offs_n, R, SLOTS, S, T, C, APPLY_MASK)
    return offs_n, kv_idx, k, v, z, s


@triton.jit
def _fwd_tile(tile, state, R, X, SLOTS, S, T, C, MASKED: tl.constexpr):
    """One key tile of the forward's online softmax: state (m_i, l_i, acc) updated."""
    m_i, l_i, acc = state
    offs_n, kv_idx, k, v, z, s = key_tile(tile, R, SLOTS, S, T, C, MASKED)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    if C.DROPOUT:
        keep = dropout_keep(S, R.pid_bh, R.offs_m[:, None], offs_n[None, :])
        p = tl.where(keep, p / (1.0 - S.DROPOUT_P), 0.0)
    # rescaled before the product, which accumulates into it (no separate sum)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=T.PRECISION)
    return m_new, l_i, acc


@triton.jit
def fwd_kernel(Q, K, V, O, LSE, SCALE, TABLE, NORMS, SLOTS, S, T, C):
    """Grid (ceil(Nq / BLOCK_M), B·H). Writes O (B, H, Nq, Dv) and base-2 LSE (B, H, Nq).
    NORMS: the features' squared norms, (B, H, Nq) and (B, Hkv, Nk) (read for SQDIST)."""
    R = query_rows(Q, K, V, NORMS, SCALE, S, T, C)
    m_i = tl.full([T.BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([T.BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([T.BLOCK_M, T.DV_PAD], dtype=tl.float32)
    row = table_row(TABLE, R.b, R.h, tl.program_id(0))
    m_i, l_i, acc = visit_tiles(row, (m_i, l_i, acc), _fwd_tile, R, None, SLOTS, S, T, C)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    keep = (R.offs_m[:, None] < S.NQ) & (R.offs_v[None, :] < T.DV)
    tl.store(head_of(O, R.b, R.h) + R.offs_m[:, None] * O.sm + R.offs_v[None, :],
             out.to(O.ptr.dtype.element_ty), mask=keep)
    lse = tl.where(empty, float("inf"), m_i + tl.log2(l_safe))
    tl.store(LSE + R.pid_bh * S.NQ + R.offs_m, lse, mask=R.offs_m < S.NQ)


@triton.jit
def _weights_tile(tile, lse, R, W, SLOTS, S, T, C, MASKED: tl.constexpr):
    """The weights of one key tile, from the rows' log-sum-exp ``lse``, stored into W."""
    offs_n = tile * T.BLOCK_N + tl.arange(0, T.BLOCK_N)
    _, _, _, s = key_logits(offs_n, R, SLOTS, S, T, C, MASKED)
    p = tl.exp2(s - lse[:, None])
    if C.DROPOUT:
        kept = dropout_keep(S, R.pid_bh, R.offs_m[:, None], offs_n[None, :])
        p = tl.where(kept, p / (1.0 - S.DROPOUT_P), 0.0)
    inside = (R.offs_m[:, None] < S.NQ) & (offs_n[None, :] < S.NK)
    tl.store(head_of(W, R.b, R.h) + R.offs_m[:, None] * W.sm + offs_n[None, :],
             p.to(W.ptr.dtype.element_ty), mask=inside)
    return lse


@triton.jit
def weights_kernel(Q, K, W, LSE, SCALE, TABLE, NORMS, SLOTS, S, T, C):
    """Grid (ceil(Nq / BLOCK_M), B·H): the attention weights W (B, H, Nq, Nk) recomputed from
    the forward's LSE on every listed tile; unlisted (empty) tiles keep W's zeros."""
    R = query_rows(Q, K, K, NORMS, SCALE, S, T, C)
    lse = tl.load(LSE + R.pid_bh * S.NQ + R.offs_m, mask=R.offs_m < S.NQ, other=float("inf"))
    row = table_row(TABLE, R.b, R.h, tl.program_id(0))
    visit_tiles(row, lse, _weights_tile, R, W, SLOTS, S, T, C)
