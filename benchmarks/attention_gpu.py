"""GPU attention benchmark: qkv's Triton kernels against torch SDPA (each backend that runs),
compiled FlexAttention, naive PyTorch and the measured bf16 matmul peak, in one call.

It first checks correctness (Triton engine vs the float64 reference, output and gradients of
q, k, v, in bf16, fp16 and fp32), then times forward, backward and forward+backward, and
prints markdown tables, then the targets as PASS/MISS. The timings also go to
benchmarks/results/gpu-<date>-<device>.json (benchmarks/results.py), which
docs/performance.md, "GPU: variants vs FlexAttention", quotes.

Setup (the issue's): bf16, D in {64, 128}, N in {1k, 2k, 4k, 8k, 16k}, B·N = 16k, 16 heads at
D=128 and 32 at D=64. TFLOP/s count only allowed score entries (4·B·H·allowed·D forward, 2.5x
that backward, the FlashAttention convention); for L1 the same count is used, so its figure
reads as "dot-product-equivalent" TFLOP/s. The default run stops starting new rows after
``--budget-s`` seconds (default 480: one call must end within 10 minutes; compiles count)
and lists what it skipped.

    python benchmarks/attention_gpu.py                      # priority order, within budget
    python benchmarks/attention_gpu.py --d 128 --n 8192     # the targets only
    python benchmarks/attention_gpu.py --d 64               # the rest, in a second call
    TRITON_INTERPRET=1 python benchmarks/attention_gpu.py --smoke   # CPU: the script's logic
"""

from __future__ import annotations

import argparse
import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

import qkv
from qkv.core.masks.rules import CausalMask, SlidingWindowMask
from qkv.core.problem import build_problem
from qkv.engines import triton as triton_engine
from results import write_results  # beside this script

WINDOW, SOFTCAP, DOC_LEN, GRAPH_DEGREE, GRAPH_SPAN = 512, 20.0, 1024, 32, 512
VARIANTS = ["dot", "causal", "alibi", "window", "softcap", "segments", "cosine", "cosine_causal",
            "l2", "l2_causal", "l1", "l1_causal", "user", "graph"]
# The weightings other than softmax (qkv.weighting), each on dot scores, stick-breaking causal;
# asked for by name (gpu_suite.sh's weightings stage). FlexAttention cannot express them, so
# their baseline is the Triton softmax at the same shape (the dot or causal row) and SDPA's.
WEIGHTINGS = ["sigmoid", "softpick", "stick_breaking", "relu", "identity", "elementwise"]
CAUSAL_WEIGHTINGS = ("stick_breaking",)  # it breaks the stick over the keys before a query
SMOKE_VARIANTS = ["dot", "causal", "alibi", "l1", "user", "sigmoid", "stick_breaking"]


@dataclass
class Variant:
    """qkv's keyword arguments plus baseline spellings: callables (q, k, v) -> out, or None."""

    kwargs: dict
    allowed: int  # allowed (query, key) pairs per (batch, head)
    flex: Callable | None = None
    sdpa: dict = field(default_factory=dict)  # backend name -> callable
    dispatched: bool = False  # also time qkv.attention's own choice ("qkv auto")
    naive: bool = True  # also time the reference (the weightings' rows need only the kernels)

    @property
    def causal(self) -> bool:
        """Whether no query sees a later key (the results' ``causal`` column)."""
        mask = self.kwargs.get("mask")
        return isinstance(mask, CausalMask) or (isinstance(mask, SlidingWindowMask)
                                                and mask.right == 0)


def _flex_compiled():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compiled flex_attention serves every variant, each a recompile: past the default
    # limit of 8, Dynamo silently runs flex_attention unfused, materializing the scores.
    for name, limit in (("recompile_limit", 256), ("accumulated_recompile_limit", 1024)):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, limit)

    return torch.compile(flex_attention, dynamic=False), create_block_mask


def _flex(n, device, score_mod=None, mask_mod=None, prepare=None, scale=None):
    def run(q, k, v):
        flex, block_mask_of = _FLEX
        if prepare is not None:
            q, k = prepare(q, k)
        block_mask = run.block_mask
        if mask_mod is not None and block_mask is None:
            block_mask = run.block_mask = block_mask_of(mask_mod, None, None, n, n, device=device)
        return flex(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

    run.block_mask = None
    return run


def _sdpa_backends(is_causal=False, prepare=None, scale=None) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(backend):
        def run(q, k, v):
            if prepare is not None:
                q, k = prepare(q, k)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)

        return run

    names = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
             "efficient": "EFFICIENT_ATTENTION"}
    return {name: make(getattr(SDPBackend, attr)) for name, attr in names.items()
            if hasattr(SDPBackend, attr)}


def _unit(q, k):
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1)


def _l2_flex(n, device, d, causal):
    """-‖q-k‖²/√D = (2q·k - ‖q‖² - ‖k‖²)/√D through norms captured by the score_mod."""
    norms = {}

    def prepare(q, k):
        norms["q"], norms["k"] = (q.float() ** 2).sum(-1), (k.float() ** 2).sum(-1)
        return q, k

    def score_mod(s, b, h, qi, ki):
        return (2 * s - norms["q"][b, h, qi] - norms["k"][b, h, ki]) / math.sqrt(d)

    mask_mod = (lambda b, h, q, k: k <= q) if causal else None
    return _flex(n, device, score_mod=score_mod, mask_mod=mask_mod, prepare=prepare, scale=1.0)


def _local_graph(n: int, device) -> torch.Tensor:
    """(2, E) edges: every node attends to itself and GRAPH_DEGREE random nodes within
    ±GRAPH_SPAN (a graph with locality, so tiles can be skipped)."""
    g = torch.Generator().manual_seed(n)
    target = torch.arange(n).repeat_interleave(GRAPH_DEGREE)
    source = (target + torch.randint(-GRAPH_SPAN, GRAPH_SPAN + 1, target.shape, generator=g))
    source = source.clamp(0, n - 1)
    self_loops = torch.arange(n)
    edges = torch.stack([torch.cat([source, self_loops]), torch.cat([target, self_loops])])
    return edges.to(device)


def make_variant(name: str, n: int, d: int, heads: int, device) -> Variant:
    causal_pairs = n * (n + 1) // 2
    causal_mod = lambda b, h, q, k: k <= q  # noqa: E731
    if name == "dot":
        return Variant({}, n * n, _flex(n, device), _sdpa_backends(), dispatched=True)
    if name == "causal":
        flex = _flex(n, device, mask_mod=causal_mod)
        return Variant({"mask": qkv.causal()}, causal_pairs, flex, _sdpa_backends(is_causal=True),
                       dispatched=True)
    if name == "alibi":
        slopes = qkv.alibi(heads).slopes.to(device)
        return Variant({"mask": qkv.causal(), "score_mod": qkv.alibi(slopes=slopes)}, causal_pairs,
                       _flex(n, device, mask_mod=causal_mod,
                             score_mod=lambda s, b, h, q, k: s - slopes[h] * (q - k).abs()))
    if name == "window":
        window_pairs = sum(min(i, WINDOW) + 1 for i in range(n))
        return Variant({"mask": qkv.sliding_window(WINDOW)}, window_pairs,
                       _flex(n, device, mask_mod=lambda b, h, q, k: (k <= q) & (q - k <= WINDOW)))
    if name == "softcap":
        return Variant({"mask": qkv.causal(), "score_mod": qkv.softcap(SOFTCAP)}, causal_pairs,
                       _flex(n, device, mask_mod=causal_mod,
                             score_mod=lambda s, b, h, q, k: SOFTCAP * torch.tanh(s / SOFTCAP)))
    if name == "segments":
        ids = (torch.arange(n, device=device) // DOC_LEN)
        pairs = int((torch.bincount(ids) ** 2).sum())
        return Variant({"mask": qkv.segments(ids)}, pairs,
                       _flex(n, device, mask_mod=lambda b, h, q, k: ids[q] == ids[k]))
    if name in ("cosine", "cosine_causal"):
        causal = name.endswith("causal")
        return Variant({"similarity": "cosine", "mask": qkv.causal() if causal else None},
                       causal_pairs if causal else n * n,
                       _flex(n, device, prepare=_unit, scale=math.sqrt(d),
                             mask_mod=causal_mod if causal else None),
                       _sdpa_backends(is_causal=causal, prepare=_unit, scale=math.sqrt(d)))
    if name in ("l2", "l2_causal"):
        causal = name.endswith("causal")
        return Variant({"similarity": "l2", "mask": qkv.causal() if causal else None},
                       causal_pairs if causal else n * n, _l2_flex(n, device, d, causal))
    if name in ("l1", "l1_causal"):
        causal = name.endswith("causal")
        return Variant({"similarity": "l1", "mask": qkv.causal() if causal else None},
                       causal_pairs if causal else n * n)
    if name == "user":  # a user's similarity: a per-dimension weighted L1, traced into Triton
        weight = torch.linspace(0.5, 1.5, d, device=device)
        similarity = qkv.Similarity(lambda a, b: -weight * (a - b).abs(), name="weighted_l1")
        return Variant({"similarity": similarity}, n * n)
    if name in WEIGHTINGS:
        causal = name in CAUSAL_WEIGHTINGS
        weighting = (qkv.weighting.elementwise(lambda s: s * torch.sigmoid(s))
                     if name == "elementwise" else name)
        return Variant({"weighting": weighting, "mask": qkv.causal() if causal else None},
                       causal_pairs if causal else n * n, naive=False)
    if name == "graph":
        edges = _local_graph(n, device)
        mask = qkv.graph(edges, num_nodes=n)
        adjacency = torch.zeros(n, n, dtype=torch.bool, device=device)
        adjacency[edges[1], edges[0]] = True
        return Variant({"mask": mask}, mask.num_edges,
                       _flex(n, device, mask_mod=lambda b, h, q, k: adjacency[q, k]))
    raise ValueError(f"unknown variant {name!r}")


def qkv_triton(q, k, v, **kwargs):
    """``qkv.attention(..., backend="triton")``; on CPU (the --smoke run, Triton's interpreter)
    the dispatcher refuses, so the engine is called directly."""
    if q.is_cuda:
        return qkv.attention(q, k, v, backend="triton", **kwargs)
    problem = build_problem(q, k, v, mask=kwargs.get("mask"), score_mod=kwargs.get("score_mod"),
                            similarity=kwargs.get("similarity", "dot"), scale=None, metric=None,
                            dropout_p=0.0, return_weights=False,
                            weighting=kwargs.get("weighting", "softmax"))
    return triton_engine.plan(problem, on_cpu=True)().out


def implementations(v: Variant) -> dict[str, Callable]:
    impls = {"qkv triton": lambda q, k, v_: qkv_triton(q, k, v_, **v.kwargs)}
    if v.dispatched:
        impls["qkv auto"] = lambda q, k, v_: qkv.attention(q, k, v_, **v.kwargs)
    impls.update({f"sdpa {name}": fn for name, fn in v.sdpa.items()})
    if v.flex is not None and _FLEX is not None:
        impls["flex (compiled)"] = v.flex
    if v.naive:
        impls["naive"] = lambda q, k, v_: qkv.attention(q, k, v_, backend="reference",
                                                        **v.kwargs)
    return impls


# -- timing -------------------------------------------------------------------------------------
def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


REPS, MIN_SECONDS = 5, 0.25  # per timing: at least this many runs and this long


def median_ms(fn: Callable[[], object]) -> float:
    fn()  # warm-up (and compile)
    fn()
    _sync()
    times = []
    start = time.perf_counter()
    while len(times) < REPS or time.perf_counter() - start < MIN_SECONDS:
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
        if len(times) >= 100:
            break
    times.sort()
    return 1e3 * times[len(times) // 2]


def matmul_peak_tflops(device, dtype=torch.bfloat16, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    return 2 * n**3 / (median_ms(lambda: a @ b) * 1e-3) / 1e12


@dataclass
class Row:
    d: int
    n: int
    batch: int
    heads: int
    variant: str
    impl: str
    causal: bool = False
    fwd_ms: float | None = None
    fwdbwd_ms: float | None = None
    flops_fwd: float = 0.0
    peak_gb: float | None = None
    note: str = ""

    def tflops(self, which: str) -> float | None:
        if which == "fwd":
            return None if self.fwd_ms is None else self.flops_fwd / self.fwd_ms / 1e9
        if self.fwdbwd_ms is None or self.fwd_ms is None:
            return None
        if which == "bwd":
            bwd_ms = self.fwdbwd_ms - self.fwd_ms
            return 2.5 * self.flops_fwd / bwd_ms / 1e9 if bwd_ms > 0 else None
        return 3.5 * self.flops_fwd / self.fwdbwd_ms / 1e9

    def record(self) -> dict:
        """The row for benchmarks/results: times in ms, TFLOP/s, peak GB."""
        def r(x, digits=3):
            return None if x is None else round(x, digits)

        return {"d": self.d, "n": self.n, "batch": self.batch, "heads": self.heads,
                "variant": self.variant, "impl": self.impl, "causal": self.causal,
                "fwd_ms": r(self.fwd_ms),
                "fwd_bwd_ms": r(self.fwdbwd_ms), "fwd_tflops": r(self.tflops("fwd"), 1),
                "bwd_tflops": r(self.tflops("bwd"), 1),
                "fwd_bwd_tflops": r(self.tflops("both"), 1), "peak_gb": r(self.peak_gb),
                "note": self.note}


def time_impl(fn, q, k, v, grad_out) -> tuple[float, float, float | None]:
    """Forward ms (no grad), forward+backward ms, peak GB of one forward+backward."""
    with torch.no_grad():
        fwd = median_ms(lambda: fn(q, k, v))
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]

    def step():
        torch.autograd.grad(fn(*leaves), leaves, grad_out)

    fwdbwd = median_ms(step)
    peak = None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = (torch.cuda.max_memory_allocated() - base) / 1e9
    return fwd, fwdbwd, peak


# -- correctness --------------------------------------------------------------------------------
def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def correctness(device, n: int, checks: list[tuple[str, int, list]]) -> list[str]:
    """Rows of a markdown table: relative errors of out and dq, dk, dv vs float64, for each
    (variant, D, dtypes) check; B=2, H=4, Hkv=2."""
    lines = ["| variant | D | dtype | out | dq | dk | dv | ok |", "|---" * 8 + "|"]
    for name, d, dtypes in checks:
        v = make_variant(name, n, d, 4, device)
        g = torch.Generator(device=device).manual_seed(0)
        drawn = [torch.randn(2, h, n, d, device=device, generator=g) for h in (4, 2, 2)]
        drawn_grad_out = torch.randn(2, 4, n, d, device=device, generator=g)
        for dtype in dtypes:
            # The reference sees the values the kernels get, rounded to dtype: the error is
            # then the kernels' own (L1's gradient moves a lot with its inputs' rounding).
            base = [t.to(dtype) for t in drawn]
            grad_out = drawn_grad_out.to(dtype)
            ref_in = [t.double().requires_grad_() for t in base]
            ref = qkv.attention(*ref_in, backend="reference", **v.kwargs)
            ref_grads = torch.autograd.grad(ref, ref_in, grad_out.double())
            lines.append(_check_row(name, d, dtype, v, base, grad_out, ref, ref_grads))
    return lines


ERROR_BOUND = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}


def _check_row(name, d, dtype, v, base, grad_out, ref, ref_grads) -> str:
    ins = [t.detach().requires_grad_() for t in base]
    try:
        out = qkv_triton(*ins, **v.kwargs)
        grads = torch.autograd.grad(out, ins, grad_out)
    except Exception as e:  # report and go on: the timings still run
        return f"| {name} | {d} | {dtype} | error: {type(e).__name__}: {e} |"
    errs = [relative_error(out, ref)]
    errs += [relative_error(a, r) for a, r in zip(grads, ref_grads, strict=True)]
    ok = "ok" if max(errs) < ERROR_BOUND[dtype] else "**FAIL**"
    return f"| {name} | {d} | {str(dtype)[6:]} | {' | '.join(f'{e:.1e}' for e in errs)} | {ok} |"


# -- the run ------------------------------------------------------------------------------------
def shapes(ds: list[int], ns: list[int], tokens: int, heads: int | None):
    """(D, N, B, H) in priority order: D=128 N=8k first (the targets), then the rest."""
    out = []
    for d in ds:
        for n in ns:
            out.append((d, n, max(1, tokens // n), heads or (16 if d >= 128 else 32)))
    return sorted(out, key=lambda s: (s[0] != 128, s[1] != 8192, s[0], s[1]))


def run_timings(args, device, deadline: float) -> tuple[list[Row], list[str]]:
    rows, skipped = [], []
    for d, n, batch, heads in shapes(args.d, args.n, args.tokens, args.heads):
        g = torch.Generator(device=device).manual_seed(n)
        q, k, v = (torch.randn(batch, heads, n, d, device=device, generator=g, dtype=args.dtype)
                   for _ in range(3))
        grad_out = torch.randn_like(q)
        for name in args.variants:
            variant = make_variant(name, n, d, heads, device)
            flops = 4.0 * batch * heads * variant.allowed * d
            for impl, fn in implementations(variant).items():
                if time.monotonic() > deadline:
                    skipped.append(f"D={d} N={n} {name} {impl}")
                    continue
                row = Row(d, n, batch, heads, name, impl, variant.causal, flops_fwd=flops)
                try:
                    row.fwd_ms, row.fwdbwd_ms, row.peak_gb = time_impl(fn, q, k, v, grad_out)
                except torch.cuda.OutOfMemoryError:
                    row.note = "OOM"
                except Exception as e:
                    row.note = f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
                finally:
                    if torch.cuda.is_available():
                        torch.cuda.empty_cache()
                rows.append(row)
                print(_row_line(row, rows), flush=True)
    return rows, skipped


def _fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _qkv_row(row: Row, rows: list[Row]) -> Row | None:
    for r in rows:
        if (r.d, r.n, r.variant, r.impl) == (row.d, row.n, row.variant, "qkv triton"):
            return r
    return None


def _row_line(row: Row, rows: list[Row]) -> str:
    ours = _qkv_row(row, rows)
    speedup = None
    if ours is not None and ours.fwdbwd_ms and row.fwdbwd_ms:
        speedup = row.fwdbwd_ms / ours.fwdbwd_ms
    return (f"| {row.d} | {row.n} | {row.batch}x{row.heads} | {row.variant} | {row.impl} | "
            f"{_fmt(row.tflops('fwd'))} | {_fmt(row.tflops('bwd'))} | {_fmt(row.tflops('both'))} | "
            f"{_fmt(row.fwd_ms, 2)} | {_fmt(row.fwdbwd_ms, 2)} | {_fmt(row.peak_gb, 2)} | "
            f"{_fmt(speedup, 2)} | {row.note} |")


TABLE_HEADER = [
    "| D | N | BxH | variant | implementation | fwd TFLOP/s | bwd TFLOP/s | fwd+bwd TFLOP/s | "
    "fwd ms | fwd+bwd ms | peak GB (fwd+bwd) | qkv speedup (fwd+bwd) | note |",
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
]


def targets(rows: list[Row], peak: float | None) -> list[str]:
    """The issue's H100 targets at D=128, N=8k, bf16, evaluated on the rows measured."""
    def get(variant, impl):
        for r in rows:
            if (r.d, r.n, r.variant, r.impl) == (128, 8192, variant, impl) and r.fwdbwd_ms:
                return r
        return None

    def ratio(a, b, key="fwdbwd_ms"):
        return None if a is None or b is None else getattr(b, key) / getattr(a, key)

    def verdict(value, bound, text):
        if value is None:
            return f"- {text}: not measured"
        return f"- {text}: {value:.2f} ({'PASS' if value >= bound else 'MISS'}, target >= {bound})"

    lines = [f"Measured bf16 matmul peak: {_fmt(peak)} TFLOP/s"]
    for name in ("dot", "causal"):
        sdpa = [r for r in rows if (r.d, r.n, r.variant) == (128, 8192, name)
                and r.impl.startswith("sdpa") and r.fwdbwd_ms]
        best = min(sdpa, key=lambda r: r.fwdbwd_ms, default=None)
        lines.append(verdict(ratio(get(name, "qkv auto"), best), 0.95,
                             f"{name}: qkv.attention's speed vs the fastest SDPA backend "
                             f"({best.impl if best else '-'}), fwd+bwd"))
    for name in ("dot", "causal"):
        lines.append(verdict(ratio(get(name, "qkv triton"), get(name, "sdpa flash")), 1.0,
                             f"{name} fwd+bwd speed vs SDPA flash"))
    fwd = get("dot", "qkv triton")
    lines.append(verdict(None if fwd is None else fwd.tflops("fwd"), 450.0, "dot forward TFLOP/s"))
    for name in ("alibi", "window", "softcap", "segments"):
        lines.append(verdict(ratio(get(name, "qkv triton"), get(name, "flex (compiled)")), 1.2,
                             f"{name} fwd+bwd speed vs compiled FlexAttention"))
    for name, base in (("cosine", "dot"), ("l2", "dot")):
        rel = ratio(get(name, "qkv triton"), get(base, "qkv triton"))
        lines.append(verdict(rel, 0.85, f"{name} speed relative to dot (fwd+bwd)"))
    lines += weighting_targets(get, ratio, verdict)
    for name in ("l1", "user"):
        ours, naive = get(name, "qkv triton"), get(name, "naive")
        lines.append(verdict(ratio(ours, naive), 5.0, f"{name} fwd+bwd speed vs naive"))
        if ours is not None:
            note = f"(naive: {naive.note})" if naive is not None and naive.note else ""
            lines.append(f"- {name} peak memory fwd+bwd: qkv {_fmt(ours.peak_gb, 2)} GB, naive "
                         f"{_fmt(None if naive is None else naive.peak_gb, 2)} GB {note}")
    return lines


def weighting_targets(get, ratio, verdict) -> list[str]:
    """Each weighting's fwd+bwd TFLOP/s as a multiple of the Triton softmax's at the same shape
    (same count of allowed pairs, so the ratio of times): >= 0.8; sigmoid >= 1.0 (FlashSigmoid's
    claim), forward and fwd+bwd. SDPA's flash softmax beside it, for scale."""
    lines = []
    for name in WEIGHTINGS:
        base = "causal" if name in CAUSAL_WEIGHTINGS else "dot"
        ours, softmax = get(name, "qkv triton"), get(base, "qkv triton")
        lines.append(verdict(ratio(ours, softmax), 1.0 if name == "sigmoid" else 0.8,
                             f"{name} fwd+bwd TFLOP/s vs the Triton softmax ({base})"))
        if name == "sigmoid":
            lines.append(verdict(ratio(ours, softmax, "fwd_ms"), 1.0,
                                 f"{name} forward TFLOP/s vs the Triton softmax ({base})"))
        sdpa = ratio(ours, get(base, "sdpa flash"))
        if sdpa is not None:
            lines.append(f"- {name} fwd+bwd speed vs SDPA flash ({base}): {sdpa:.2f}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--n", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="B·N")
    chosen = parser.add_mutually_exclusive_group()
    chosen.add_argument("--variants", nargs="+", choices=VARIANTS + WEIGHTINGS,
                        help="default: " + " ".join(VARIANTS) + " (with --smoke: "
                             + " ".join(SMOKE_VARIANTS) + ")")
    chosen.add_argument("--weightings", action="store_true",
                        help="each weighting beside the Triton softmax it is held to: "
                             + " ".join(["dot", "causal", *WEIGHTINGS]))
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--no-flex", action="store_true")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the correctness checks (their compiles and float64 references "
                             "can take a short call's whole budget)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny CPU run of the whole script (set TRITON_INTERPRET=1)")
    args = parser.parse_args()
    start = time.monotonic()
    device = torch.device("cpu" if args.smoke else "cuda")
    args.dtype = torch.float32 if args.smoke else torch.bfloat16
    args.heads = None
    if args.smoke:
        global REPS, MIN_SECONDS
        args.d, args.n, args.tokens, args.heads, REPS, MIN_SECONDS = [16], [64], 64, 2, 1, 0.0
    if args.weightings:
        args.variants = ["dot", "causal", *WEIGHTINGS]
    args.variants = args.variants or (SMOKE_VARIANTS if args.smoke else VARIANTS)
    global _FLEX
    _FLEX = None if args.no_flex or args.smoke else _flex_compiled()
    import triton

    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor()
    print(f"# qkv attention on GPU — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"device: {name}; torch {torch.__version__}; triton {triton.__version__}; "
          f"CUDA {torch.version.cuda}; dtype {args.dtype}\n")
    if not args.no_check:
        print_correctness(args, device)
    peak = None if args.smoke else matmul_peak_tflops(device)
    print(f"\n## Timings (bf16 matmul peak {_fmt(peak)} TFLOP/s)\n")
    print("\n".join(TABLE_HEADER), flush=True)
    rows, skipped = run_timings(args, device, start + args.budget_s)
    print("\n## Targets (H100, bf16, D=128, N=8k)\n")
    print("\n".join(targets(rows, peak)))
    if skipped:
        print(f"\nSkipped for the time budget ({len(skipped)}): " + "; ".join(skipped))
    if not args.smoke and rows:  # the interpreter's times measure nothing
        write_results("gpu", [r.record() for r in rows], device, dtype=str(args.dtype)[6:],
                      matmul_peak_tflops=None if peak is None else round(peak, 1),
                      skipped=skipped)
    print(f"\ntotal {time.monotonic() - start:.0f} s")


def print_correctness(args, device) -> None:
    print("## Correctness (relative error vs float64: out, dq, dk, dv)\n")
    # Every variant in bf16 at the largest timed head dim (the timings reuse these compiles),
    # and a few in fp16 and fp32 at the smallest: compiles are the slow part of a first call.
    main_dtype, other = [args.dtype], [torch.float16, torch.float32]
    checks = [(name, max(args.d), main_dtype) for name in args.variants]
    if not args.smoke:
        checks += [(name, min(args.d), other) for name in ("causal", "alibi", "l1")]
    for line in correctness(device, 40 if args.smoke else 1000, checks):
        print(line, flush=True)


_FLEX = None

if __name__ == "__main__":
    main()
