"""The fused CPU engine's C loops (``cpu_kernels.c``): the per-element work torch has no
single operation for.

- L1: -‖q-k‖₁ has no matrix-multiply form, so it is O(m·n·d) elementwise work either way;
  the C loops vectorize across keys instead of across d (about 10x faster than
  ``torch.cdist`` forward, 3.5x backward, on a tile).
- Softmax steps: the online-softmax update of a tile (row max, exp, row sum, rescaling of
  the output, the mask), the backward's exp(s - lse) and p(dp - delta), each in one or two
  passes over a row held in cache, instead of one pass over the whole tile per torch op.
- Graph edges: per-edge scores, weighted scatters and kernel gradients that read the query,
  key and value rows in place instead of gathering a copy per edge.
- Query blocks (``cpu_blocks.c``, in the same library; their Python side is
  ``native_blocks``): a whole block of queries head by head, calling the loops above and the
  weightings' steps (``cpu_weights.c``).

The sources are compiled once per machine with the system C compiler (``$CC``, else ``cc``
or ``gcc``) for ``-march=$QKV_MARCH`` (default ``native``) into ``$QKV_CACHE`` (default
``~/.cache/qkv``), which takes about two seconds; generated sources (a user's similarity
term, ``kernelgen.c``) are built the same way (``compile_library``). Without a compiler, or
with ``QKV_NATIVE=0``, ``available()`` is False and the engines use torch operations (``cdist``
with autograd for L1, the reference's own formula), with one warning per process. The C code
is called through ctypes, which releases the GIL, so the engine's workers run it in parallel.
docs/portability.md covers the targets, compilers and machines.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from ..lowering import TermKind, term_kind
from . import build

# One library: the tile kernels, then the query blocks that call them (``native_blocks``).
SOURCES = [Path(__file__).with_name(name)
            for name in ("exp_nonpositive.c", "cpu_kernels.c", "cpu_weights.c", "cpu_blocks.c")]
_BLOCK = 64  # BLOCK in cpu_kernels.c: keys per transposed block of the L1 loops
_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}

_lock = threading.Lock()
_functions: dict[tuple[str, torch.dtype], ctypes._CFuncPtr] | None = None
_tried = False

_PTR, _I64 = ctypes.c_void_p, ctypes.c_int64
_SIGNATURES = {
    "l1_scores": [_PTR] * 3 + [_I64] * 6 + [_PTR],
    "l1_grads": [_PTR] * 5 + [_I64] * 8,
    "online_softmax_step": [_PTR, _I64, _I64] + [_PTR] * 3 + [_I64, _PTR] + [_I64] * 4,
    "exp_sub_rows": [_PTR, _I64, _I64, _PTR, _PTR] + [_I64] * 4,
    "block_forward": [_PTR] + [_I64] * 3 + [_PTR] * 4,
    "block_backward": [_PTR] + [_I64] * 3 + [_PTR] * 6,
    # L1's loops under a generated term's signature, for the C blocks (read by address)
    "l1_term_scores": [_PTR] * 3 + [_I64] * 6 + [_PTR, ctypes.c_double] + [_PTR] * 4,
    "l1_term_grads": [_PTR] * 5 + [_I64] * 8 + [ctypes.c_double] + [_PTR] * 8,
    "softmax_grad_rows": [_PTR, _PTR, _I64, _I64, _PTR, _PTR, ctypes.c_double],
    "edge_scores": [_I64] + [_PTR] * 5 + [_I64] * 7,
    "edge_scatter": [_PTR] * 5 + [_I64] * 8,
    "edge_kernel_grads": [_I64] + [_PTR] * 7 + [_I64] * 7,
}
# Functions that return a status: nonzero means an id they do not know.
_CHECKED = {"edge_scores", "edge_kernel_grads"}
# The term kinds the C edge loops compute (``cpu_kernels.c``).
EDGE_TERMS = frozenset({TermKind.DOT, TermKind.SQDIST, TermKind.L1})


def exp_source() -> str:
    """exp(x) for x <= 0 as the C loops compute it (``exp_nonpositive.c``), for another
    source to begin with."""
    return SOURCES[0].read_text()


def compile_library(source: str, stem: str,
                    extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """Build (or find in ``$QKV_CACHE``) and load generated C source, with ``extra_flags``
    after the usual ones; None without a compiler or with ``QKV_NATIVE=0``. Raises
    ``OSError`` / ``SubprocessError`` when the source does not compile."""
    compiler = build.compiler()
    if compiler is None or _load() is None:
        return None
    return ctypes.CDLL(str(build.build(compiler, source.encode(), stem, extra_flags)))


def optional_library(source: Path, stem: str, extra_flags: tuple[str, ...] = ()):
    """``compile_library`` of the C file ``source`` for code that has a fallback: None also
    when it does not build."""
    try:
        return compile_library(source.read_text(), stem, extra_flags)
    except (OSError, subprocess.SubprocessError):
        return None


def _load() -> dict | None:
    """{(name, dtype): C function} and "vector_bytes" (the L1 gradient loop's vector width),
    built and loaded on the first call; None without them."""
    global _functions, _tried
    if _tried:  # every tile asks: no lock once decided
        return _functions
    with _lock:
        if not _tried:
            _functions = _open()
            _tried = True
    return _functions


def _notice(reason: str) -> None:
    warnings.warn(f"qkv: {reason}; the CPU engines use torch operations (the same results, "
                  "slower)", RuntimeWarning, stacklevel=5)


def _open() -> dict | None:
    """The C functions, or None with one warning saying why not (once per process)."""
    compiler = build.compiler()
    if compiler is None:
        _notice("QKV_NATIVE=0" if os.environ.get("QKV_NATIVE", "1") == "0"
                else "no C compiler (set CC, or install cc or gcc)")
        return None
    target = build.march()
    if missing := build.missing_features(target):
        _notice(f"QKV_MARCH={target} needs CPU features this CPU lacks ({' '.join(missing)})")
        return None
    try:
        lib = ctypes.CDLL(str(build.build(
            compiler, b"\n".join(p.read_bytes() for p in SOURCES), "cpu_kernels")))
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or err
        _notice(f"the C tile kernels did not build ({detail})")
        return None
    functions = {}
    for name, argtypes in _SIGNATURES.items():
        for dtype, suffix in _SUFFIX.items():
            function = getattr(lib, f"{name}_{suffix}")
            function.argtypes = argtypes
            function.restype = ctypes.c_int64 if name in _CHECKED else None
            functions[name, dtype] = function
    lib.l1_vector_bytes.restype = ctypes.c_int64
    functions["vector_bytes"] = lib.l1_vector_bytes()  # the L1 gradient loop's vector width
    return functions


def address_of(function) -> int:
    """The address of a ctypes C function, for C code that calls it (the C query blocks)."""
    return ctypes.cast(function, _PTR).value


def available(dtype: torch.dtype) -> bool:
    """Whether the C kernel serves CPU tensors of ``dtype`` (it is built on first call)."""
    return _load() is not None and dtype in _SUFFIX


class TileLoops:
    """C loops for one pairwise term on tiles: ``scores(q, k, out)`` and
    ``add_grads(ds, q, k, dq, dk) -> grads of tensors``, which adds the term's gradients into
    dq and dk and returns one gradient per tensor in ``tensors`` (the tensors the loops read,
    as autograd should see them; 0 for those that need none). Generated loops also run along
    graph edges: ``edge_scores(q_rows, k_rows, target, source)`` and
    ``edge_grads(ds, q_rows, k_rows, target, source, dq, dk) -> grads of tensors``, laid out
    as ``edge_scores`` and ``edge_kernel_grads`` below; None for the hand-written L1 loops
    (the edge loops here take L1 by its id). ``c_term``: for C callers (the C query blocks),
    the generated loops' addresses (scores, grads), slot pointers and scale."""

    def __init__(self, scores, add_grads, edge_scores=None, edge_grads=None,
                 tensors: tuple[Tensor, ...] = (), c_term: tuple | None = None):
        self.scores, self.add_grads, self.tensors = scores, add_grads, tensors
        self.edge_scores, self.edge_grads = edge_scores, edge_grads
        self.c_term = c_term


def tile_loops(pair, dtype: torch.dtype) -> TileLoops | None:
    """The C tile loops written for ``pair`` (a ``similarity.Pairwise``), or None: only
    -‖q-k‖₁ has them, the others are matrix products."""
    if term_kind(pair) is TermKind.L1 and available(dtype):
        return _L1_LOOPS
    return None


def edge_loops(pair, dtype: torch.dtype) -> bool:
    """Whether the C edge loops compute ``pair`` for ``dtype``."""
    return term_kind(pair) in EDGE_TERMS and available(dtype)


def row_view(t: Tensor, written: bool = False) -> tuple[Tensor, int] | None:
    """t (..., m, d) as (nb, m, d) whose rows are d contiguous elements one after another,
    and the step in elements from one batch item to the next, without a copy (a tile sliced
    along m out of a contiguous (B, H, N, d) tensor is one); None when t's layout has no
    such view, or when ``written`` and its batch items overlap."""
    m, d = t.shape[-2], t.shape[-1]
    try:
        t3 = t.view(-1, m, d)
    except RuntimeError:
        return None
    if (d > 1 and t3.stride(2) != 1) or (m > 1 and t3.stride(1) != d):
        return None
    step = t3.stride(0) if t3.shape[0] > 1 else m * d
    return None if written and step < m * d else (t3, step)


def rows_of(t: Tensor) -> tuple[Tensor, int]:
    """``row_view`` of t, or of a contiguous copy when t has none."""
    return row_view(t) or (t.reshape(-1, t.shape[-2], t.shape[-1]).contiguous(),
                           t.shape[-2] * t.shape[-1])


def add_rows_into(compute, *targets: Tensor) -> None:
    """Run ``compute(*(view, step) per target)``, which adds into each target's rows: in
    place where ``row_view`` allows, else into zeroed copies added to the targets after."""
    views = [row_view(t, written=True) for t in targets]
    if all(v is not None for v in views):
        compute(*views)
        return
    copies = [torch.zeros(t.shape, dtype=t.dtype) for t in targets]
    compute(*(row_view(c) for c in copies))
    for target, copy in zip(targets, copies, strict=True):
        target += copy


def l1_scores(q: Tensor, k: Tensor, out: Tensor | None = None) -> Tensor:
    """-‖q-k‖₁ (..., m, n) for q (..., m, d) and k (..., n, d), with the same leading dims;
    written into ``out`` (contiguous) when given."""
    (q3, q_step), (k3, k_step) = rows_of(q), rows_of(k)
    nb, m, d = q3.shape
    n = k3.shape[1]
    if out is None:
        out = q.new_empty(nb, m, n)
    elif not out.is_contiguous() or out.numel() != nb * m * n:
        raise ValueError("out must be contiguous with one score per (query, key) pair")
    scratch = q.new_empty(_BLOCK * d)
    _load()["l1_scores", q.dtype](q3.data_ptr(), k3.data_ptr(), out.data_ptr(), nb, m, n, d,
                                  q_step, k_step, scratch.data_ptr())
    return out.view(*q.shape[:-1], n)


def add_l1_grads(ds: Tensor, q: Tensor, k: Tensor, dq: Tensor, dk: Tensor) -> None:
    """Add the gradients of Σ ds·(-‖q-k‖₁) into dq (like q) and dk (like k), for
    ds (..., m, n); sign(0) counts as 0."""
    d = q.shape[-1]
    lanes = _load()["vector_bytes"] // q.element_size()  # d is padded to a multiple
    pad = -d % lanes  # zero dims on both sides: q - k = 0 there, no gradient
    if pad:
        gq, gk = l1_grads(ds, F.pad(q, (0, pad)), F.pad(k, (0, pad)))
        dq += gq[..., :d]
        dk += gk[..., :d]
        return
    (q3, q_step), (k3, k_step) = rows_of(q), rows_of(k)
    ds3 = ds.reshape(-1, ds.shape[-2], ds.shape[-1]).contiguous()
    nb, m, _ = q3.shape
    n = k3.shape[1]

    def add(dq_rows, dk_rows):
        _load()["l1_grads", q.dtype](ds3.data_ptr(), q3.data_ptr(), k3.data_ptr(),
                                     dq_rows[0].data_ptr(), dk_rows[0].data_ptr(), nb, m, n, d,
                                     q_step, k_step, dq_rows[1], dk_rows[1])

    add_rows_into(add, dq, dk)


def l1_grads(ds: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """Gradients (dq, dk) of Σ ds·(-‖q-k‖₁), for ds (..., m, n); sign(0) counts as 0."""
    dq, dk = torch.zeros_like(q), torch.zeros_like(k)
    add_l1_grads(ds, q, k, dq, dk)
    return dq, dk


def _add_l1_tile_grads(ds: Tensor, q: Tensor, k: Tensor, dq: Tensor, dk: Tensor) -> tuple:
    add_l1_grads(ds, q, k, dq, dk)  # looked up at call time, as l1_scores below
    return ()  # L1 reads no tensor


# Looked up at call time, so the module's functions stay the one place to change (or patch).
_L1_LOOPS = TileLoops(lambda q, k, out=None: l1_scores(q, k, out), _add_l1_tile_grads)


def _rows(t: Tensor) -> int:
    if not t.is_contiguous():
        raise ValueError("the C softmax steps need contiguous tensors")
    return t.numel() // t.shape[-1]


def _mask_layout(allowed: Tensor | None, shape) -> tuple:
    """(pointer, heads, bq, batch stride, head stride) of a bool mask broadcastable to the
    tile shape (B, H, bq, bk), as the C loops read it; the tensor that owns the memory is
    returned first, so the caller keeps it alive for the call."""
    if allowed is None:
        return None, (None, 1, 1, 0, 0)
    b, h, bq, bk = shape
    allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
    bm, hm = allowed.shape[0], allowed.shape[1]
    allowed = allowed.expand(bm, hm, bq, bk).contiguous()
    return allowed, (allowed.data_ptr(), h, bq, hm * bq * bk if bm > 1 else 0,
                     bq * bk if hm > 1 else 0)


def online_softmax_step(s: Tensor, row_max: Tensor, row_sum: Tensor, acc: Tensor,
                        allowed: Tensor | None = None) -> None:
    """One online-softmax update, in place: s (B, H, bq, bk) becomes exp(s - max) with the
    running max, 0 where the bool mask ``allowed`` (broadcastable to s) forbids; row_max and
    row_sum (B, H, bq, 1) are updated, and each row of the output accumulator acc
    (B, H, bq, dv) is rescaled by exp(old max - new max). All contiguous, same dtype."""
    if acc.numel() // acc.shape[-1] != _rows(s) or not acc.is_contiguous():
        raise ValueError("acc must be contiguous with one row per score row")
    _owner, layout = _mask_layout(allowed, s.shape)  # _owner holds the mask's memory
    _load()["online_softmax_step", s.dtype](s.data_ptr(), _rows(s), s.shape[-1],
                                            row_max.data_ptr(), row_sum.data_ptr(),
                                            acc.data_ptr(), acc.shape[-1], *layout)


def exp_sub_rows(s: Tensor, lse: Tensor, allowed: Tensor | None = None) -> Tensor:
    """s (B, H, bq, bk) <- exp(s - lse) in place for lse (B, H, bq, 1), 0 where the bool mask
    ``allowed`` forbids; +inf in lse gives a row of 0."""
    lse = lse.contiguous()
    _owner, layout = _mask_layout(allowed, s.shape)  # _owner holds the mask's memory
    _load()["exp_sub_rows", s.dtype](s.data_ptr(), _rows(s), s.shape[-1], lse.data_ptr(),
                                     *layout)
    return s


def softmax_grad_rows(p: Tensor, dp: Tensor, delta: Tensor, slope: Tensor | None = None,
                      scale: float = 1.0) -> Tensor:
    """dp (..., n) <- p * (dp - delta) in place, for delta (..., 1): the gradient of a
    softmax tile's scores; with ``slope`` (a score modifier's derivative, like p), that times
    slope * scale where it is not 0. p, dp and slope contiguous, same shape and dtype."""
    if p.shape != dp.shape or not p.is_contiguous():
        raise ValueError("p must be contiguous, of dp's shape")
    if slope is not None and (slope.numel() != p.numel() or not slope.is_contiguous()):
        raise ValueError("slope must be contiguous, with one value per score")
    delta = delta.contiguous()
    _load()["softmax_grad_rows", p.dtype](p.data_ptr(), dp.data_ptr(), _rows(dp), dp.shape[-1],
                                          delta.data_ptr(),
                                          None if slope is None else slope.data_ptr(), scale)
    return dp


# Graph attention along edges. Rows are (B, N, heads, d) contiguous; per-edge values
# (B, E, H); target and source are int64 (E,) node indices.


def _check_rows(*rows: Tensor) -> None:
    if not all(t.is_contiguous() for t in rows):
        raise ValueError("edge rows must be contiguous (B, N, heads, d)")


def _edge_term(kind: TermKind) -> TermKind:
    if kind not in EDGE_TERMS:
        raise ValueError(f"the C edge loops have no code for pairwise term {kind!r}; they know "
                         f"{sorted(k.name for k in EDGE_TERMS)}")
    return kind


def _checked(status: int, kind: TermKind) -> None:
    if status:
        raise ValueError(f"the C edge loops rejected pairwise term {kind!r}")


def edge_scores(kind: TermKind, q_rows: Tensor, k_rows: Tensor, target: Tensor,
                source: Tensor) -> Tensor:
    """(B, E, H): the pairwise term of ``kind`` of each edge's query (target) and key
    (source) rows."""
    _check_rows(q_rows, k_rows, target, source)
    batch, nq, heads, d = q_rows.shape
    out = q_rows.new_empty(batch, target.numel(), heads)
    status = _load()["edge_scores", q_rows.dtype](
        _edge_term(kind), q_rows.data_ptr(), k_rows.data_ptr(), target.data_ptr(),
        source.data_ptr(), out.data_ptr(), batch, target.numel(), nq, k_rows.shape[1], heads,
        k_rows.shape[2], d)
    _checked(status, kind)
    return out


def edge_scatter(weights: Tensor, x_rows: Tensor, frm: Tensor, to: Tensor, out: Tensor) -> None:
    """out[:, to[e]] += weights[:, e] * x[:, frm[e]] per head, in place; weights (B, E, H),
    x_rows (B, N_from, Hx, d), out (B, N_to, Hout, d), with Hx and Hout dividing H."""
    _check_rows(weights, x_rows, frm, to, out)
    batch, edges, heads = weights.shape
    _load()["edge_scatter", weights.dtype](
        weights.data_ptr(), x_rows.data_ptr(), frm.data_ptr(), to.data_ptr(), out.data_ptr(),
        batch, edges, x_rows.shape[1], out.shape[1], heads, x_rows.shape[2], out.shape[2],
        out.shape[3])


def edge_kernel_grads(kind: TermKind, ds: Tensor, q_rows: Tensor, k_rows: Tensor, target: Tensor,
                      source: Tensor, dq: Tensor, dk: Tensor) -> None:
    """dq[:, target] += ds · ∂term/∂q and dk[:, source] += ds · ∂term/∂k, in place, for
    ds (B, E, H) = d(loss)/d(edge scores); dq and dk are laid out like q_rows and k_rows."""
    _check_rows(ds, q_rows, k_rows, target, source, dq, dk)
    batch, nq, heads, d = q_rows.shape
    status = _load()["edge_kernel_grads", q_rows.dtype](
        _edge_term(kind), ds.data_ptr(), q_rows.data_ptr(), k_rows.data_ptr(),
        target.data_ptr(), source.data_ptr(), dq.data_ptr(), dk.data_ptr(), batch,
        target.numel(), nq, k_rows.shape[1], heads, k_rows.shape[2], d)
    _checked(status, kind)
