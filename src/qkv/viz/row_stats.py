"""The per-row summaries of a block of attention scores in one C pass per row.

A block holds the scores of some query rows of some heads against keys 0..n-1 (a torch
matrix multiply computes them). Per row, with keys 0..hi allowed (hi = the query's position
under a causal mask, n - 1 without one) and a shift m (the engine's log-sum-exp, or else the
row's maximum), the loop computes e = exp(s - m), z = Σ e, Σ e·(s - m) and Σ e·|i - j|, then
p = e / z, and from them:

- the entropy of the row, log z - Σ e·(s - m) / z, in bits;
- the mean distance Σ p·|i - j| (i the query's position, j the key's);
- the weight on key 0 (the sink) and on key i - 1 (the previous token);
- p added to the head's per-key sums (the mass each key receives);
- the row's ``k`` largest weights and their keys (ties: the earlier key), descending;

and leaves p in the block (0 past hi), for callers that keep some heads' maps. Two passes
over a row that stays in cache, and a scan for the top keys, instead of one pass over the
whole block per torch operation. Without a C compiler ``library()`` is None and
``qkv.viz.summaries`` computes the same with torch operations.
"""

from __future__ import annotations

import ctypes
import functools
import subprocess

import torch
from torch import Tensor

from ..engines.cpu import native

STATS = ("entropy", "distance", "sink", "previous")  # the columns of a row's stats

SOURCE = r"""
#include <stdint.h>
#include <math.h>

/* s: (heads, rows, n) scores, row i of each head at position first + i; shift: (heads,
 * rows) or 0; stats: (heads, rows, 4); received: per head a row of at least n sums, head h's
 * at received + h * received_step; top_keys, top_values: (heads, rows, k). */
void qkv_row_stats(float *s, int64_t heads, int64_t rows, int64_t n, const float *shift,
                   int64_t first, int64_t causal, float *stats, float *received,
                   int64_t received_step, int64_t k, int64_t *top_keys, float *top_values) {
    for (int64_t h = 0; h < heads; h++) {
        float *rec = received + h * received_step;
        for (int64_t i = 0; i < rows; i++) {
            const int64_t r = h * rows + i, pos = first + i;
            float *row = s + r * n, *st = stats + r * 4, *tv = top_values + r * k;
            int64_t *tk = top_keys + r * k;
            const int64_t hi = causal ? (pos < n - 1 ? pos : n - 1) : n - 1;
            for (int64_t t = 0; t < k; t++) { tk[t] = -1; tv[t] = 0.0f; }
            st[0] = st[1] = st[2] = st[3] = 0.0f;
            if (hi < 0) {
                for (int64_t j = 0; j < n; j++) row[j] = 0.0f;
                continue;
            }
            float m = shift ? shift[r] : -INFINITY;
            if (!isfinite(m)) {
                m = row[0];
                #pragma omp simd reduction(max:m)
                for (int64_t j = 0; j <= hi; j++) m = row[j] > m ? row[j] : m;
            }
            float z = 0.0f, zt = 0.0f, zd = 0.0f;
            const float at = (float)pos;
            #pragma omp simd reduction(+:z, zt, zd)
            for (int64_t j = 0; j <= hi; j++) {
                const float t = row[j] - m, e = exp_nonpositive_f32(t);
                row[j] = e;
                z += e;
                zt += e * t;
                zd += e * fabsf(at - (float)j);
            }
            const float inv = 1.0f / z;
            st[0] = (logf(z) - zt * inv) * 1.44269504088896341f;
            st[1] = zd * inv;
            #pragma omp simd
            for (int64_t j = 0; j <= hi; j++) {
                const float p = row[j] * inv;
                row[j] = p;
                rec[j] += p;
            }
            for (int64_t j = hi + 1; j < n; j++) row[j] = 0.0f;
            st[2] = row[0];
            st[3] = pos >= 1 && pos - 1 <= hi ? row[pos - 1] : 0.0f;
            /* The k largest: a chunk of 16 is scanned one by one only when one of its
             * weights beats the k-th kept so far. */
            int64_t count = 0;
            float kth = 0.0f;
            for (int64_t j0 = 0; j0 <= hi; j0 += 16) {
                const int64_t end = j0 + 16 <= hi + 1 ? j0 + 16 : hi + 1;
                int hit = 0;
                for (int64_t j = j0; j < end; j++) hit |= row[j] > kth;
                if (!hit) continue;
                for (int64_t j = j0; j < end; j++) {
                    const float v = row[j];
                    if (!(v > kth)) continue;
                    int64_t at_ = count < k ? count++ : k - 1;
                    while (at_ > 0 && tv[at_ - 1] < v) {
                        tv[at_] = tv[at_ - 1];
                        tk[at_] = tk[at_ - 1];
                        at_--;
                    }
                    tv[at_] = v;
                    tk[at_] = j;
                    if (count == k) kth = tv[k - 1];
                }
            }
        }
    }
}
"""

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def library():
    """The compiled ``qkv_row_stats``, or None without a C compiler (or with QKV_NATIVE=0)."""
    try:
        lib = native.compile_library(native.exp_source() + SOURCE, "viz_row_stats")
    except (OSError, subprocess.SubprocessError):
        return None
    if lib is None:
        return None
    fn = lib.qkv_row_stats
    fn.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR]
    fn.restype = None
    return fn


def row_stats(s: Tensor, shift: Tensor | None, first: int, causal: bool, received: Tensor,
              top_k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The module docstring's loop over a block; s is overwritten with the weights.

    Args:
        s: (h, R, n) contiguous float32 scores of R query rows at positions first..first+R-1
            against keys 0..n-1.
        shift: (h, R) contiguous float32 log-sum-exp of the rows, or None (the row maximum).
        causal: keys up to the query's position only; else all n.
        received: (h, >= n) float32 per-key sums, rows contiguous; p is added to it.

    Returns:
        stats (h, R, 4) in ``STATS`` order, top keys (h, R, top_k) int64 (-1 past the
        allowed keys) and their weights (h, R, top_k) float32.
    """
    heads, rows, n = s.shape
    fn = library()
    if fn is None:
        raise RuntimeError("the row summaries' C loop is not built (no C compiler)")
    if not (s.is_contiguous() and s.dtype == torch.float32 and received.stride(1) == 1
            and received.dtype == torch.float32 and received.shape[1] >= n):
        raise ValueError("row_stats needs contiguous float32 scores and per-key sums")
    if shift is not None and (tuple(shift.shape) != (heads, rows) or not shift.is_contiguous()):
        raise ValueError(f"shift must be contiguous ({heads}, {rows})")
    stats = torch.empty(heads, rows, len(STATS))
    keys = torch.empty(heads, rows, top_k, dtype=torch.int64)
    values = torch.empty(heads, rows, top_k)
    fn(s.data_ptr(), heads, rows, n, None if shift is None else shift.data_ptr(), first,
       int(causal), stats.data_ptr(), received.data_ptr(), received.stride(0), top_k,
       keys.data_ptr(), values.data_ptr())
    return stats, keys, values
