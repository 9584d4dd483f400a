"""CPU attention benchmark: qkv versus naive attention, compiled FlexAttention and torch SDPA.

Every figure in one table comes from one run, measured side by side (the machines are shared
and noisy; ratios are what to read). Setup: B=1, H=8, D=64, float32, torch's thread count.
Ratios are baseline time / qkv time, so > 1 means qkv is faster.

    python benchmarks/attention_cpu.py                  # N=4096, every variant (a few minutes)
    python benchmarks/attention_cpu.py --n 1024 4096    # more sizes
    python benchmarks/attention_cpu.py --large          # N=16384: window and graph speedups, memory
    python benchmarks/attention_cpu.py --causal-65536   # causal forward+backward at N=65536
    python benchmarks/attention_cpu.py --dispatch       # qkv.attention's overhead over SDPA
    python benchmarks/attention_cpu.py --user-similarity --no-table   # a user L1 vs built-in
    python benchmarks/attention_cpu.py --vs-sdpa --no-table --n 4096 16384   # engine vs SDPA

Each run also writes its figures to benchmarks/results/attention_cpu-<date>-<machine>.json
(benchmarks/results.py); docs/performance.md quotes them.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import qkv
from qkv.bars import bar
from results import write_results  # beside this script

B, H, D = 1, 8, 64
WINDOW = 256
SOFTCAP = 20.0
# A baseline that materializes (B, H, N, N) float32 scores runs only below this many bytes.
DENSE_BUDGET = 6 << 30


@dataclass
class Case:
    """Inputs and per-engine spellings of one variant at one N. ``flex`` and ``sdpa`` are
    callables (q, k, v) -> out, or None where that engine cannot express the variant."""

    kwargs: dict
    flex: Callable | None
    sdpa: Callable | None


def _inputs(n: int, requires_grad: bool = False):
    gen = torch.Generator().manual_seed(n)
    return [torch.randn(B, H, n, D, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


def _flex_fn():
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None, None
    # One compiled kernel per variant; past the default limit of 8, dynamo would silently fall
    # back to Flex's unfused, materializing path.
    torch._dynamo.config.recompile_limit = 64
    return torch.compile(flex_attention, dynamic=False), create_block_mask


_FLEX, _BLOCK_MASK = None, None


def _flex(score_mod=None, mask_mod=None, n=0, prepare=None, scale=None):
    """A FlexAttention call (compiled on first use); ``prepare`` maps q, k first."""
    global _FLEX, _BLOCK_MASK
    if _FLEX is None:
        _FLEX, _BLOCK_MASK = _flex_fn()
    if _FLEX is None:
        return None
    block_mask = _BLOCK_MASK(mask_mod, None, None, n, n, device="cpu") if mask_mod else None

    def run(q, k, v):
        if prepare is not None:
            q, k = prepare(q, k)
        return _FLEX(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale)

    return run


def _sdpa(n, attn_mask=None, is_causal=False, prepare=None, scale=None):
    if attn_mask is not None and attn_mask.numel() * 4 > DENSE_BUDGET // 4:
        return None

    def run(q, k, v):
        if prepare is not None:
            q, k = prepare(q, k)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale
        )

    return run


def _graph_edges(n: int, degree: int = 16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    target = torch.arange(n).repeat_interleave(degree)
    source = torch.randint(0, n, (n * degree,), generator=gen)
    return torch.stack([source, target])


def _unit(q, k):
    return F.normalize(q, dim=-1), F.normalize(k, dim=-1)


def _l2_flex(n, prepare=None):
    """-‖q-k‖²/√D as q·k plus norms, which FlexAttention can express through captured norms."""
    norms = {}

    def prep(q, k):
        if prepare is not None:
            q, k = prepare(q, k)
        norms["q"], norms["k"] = (q * q).sum(-1), (k * k).sum(-1)
        return q, k

    def score_mod(s, b, h, qi, ki):
        return (2 * s - norms["q"][b, h, qi] - norms["k"][b, h, ki]) / math.sqrt(D)

    return _flex(score_mod=score_mod, n=n, prepare=prep, scale=1.0)


def make_case(name: str, n: int) -> Case:
    """The variant ``name`` at sequence length ``n``, for qkv and for each baseline."""
    if name == "dot":
        return Case({}, _flex(n=n), _sdpa(n))
    if name == "causal":
        return Case({"mask": qkv.causal()}, _flex(mask_mod=lambda b, h, q, k: k <= q, n=n),
                    _sdpa(n, is_causal=True))
    if name == "alibi":
        mod = qkv.alibi(H)
        s = mod.slopes
        dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().float()
        bias = -s.view(H, 1, 1) * dist if H * n * n * 4 <= DENSE_BUDGET // 4 else None
        return Case(
            {"score_mod": mod},
            _flex(score_mod=lambda sc, b, h, q, k: sc - s[h] * (q - k).abs(), n=n),
            _sdpa(n, attn_mask=bias) if bias is not None else None,
        )
    if name == "window":
        mask = torch.ones(n, n, dtype=torch.bool).tril().triu(-WINDOW) if n <= 8192 else None
        return Case(
            {"mask": qkv.sliding_window(WINDOW)},
            _flex(mask_mod=lambda b, h, q, k: (k <= q) & (q - k <= WINDOW), n=n),
            _sdpa(n, attn_mask=mask) if mask is not None else None,
        )
    if name == "softcap":
        return Case({"score_mod": qkv.softcap(SOFTCAP)},
                    _flex(score_mod=lambda s, b, h, q, k: SOFTCAP * torch.tanh(s / SOFTCAP), n=n),
                    None)
    if name == "segments":
        ids = torch.arange(n) * 4 // n
        mask = ids[:, None] == ids[None, :] if n <= 8192 else None
        return Case({"mask": qkv.segments(ids)},
                    _flex(mask_mod=lambda b, h, q, k: ids[q] == ids[k], n=n),
                    _sdpa(n, attn_mask=mask) if mask is not None else None)
    if name == "cosine":
        return Case({"similarity": "cosine"}, _flex(n=n, prepare=_unit, scale=math.sqrt(D)),
                    _sdpa(n, prepare=_unit, scale=math.sqrt(D)))
    if name == "l2":
        return Case({"similarity": "l2"}, _l2_flex(n), None)
    if name == "l1":
        return Case({"similarity": "l1"}, None, None)
    if name == "mahalanobis":
        metric = torch.eye(D) + 0.1 * torch.randn(D, D, generator=torch.Generator().manual_seed(1))
        return Case({"similarity": "mahalanobis", "metric": metric},
                    _l2_flex(n, prepare=lambda q, k: (q @ metric.T, k @ metric.T)), None)
    if name == "graph":
        edges = _graph_edges(n)
        adjacency = torch.zeros(n, n, dtype=torch.bool)
        adjacency[edges[1], edges[0]] = True
        return Case({"mask": qkv.graph(edges, num_nodes=n)},
                    _flex(mask_mod=lambda b, h, q, k: adjacency[q, k], n=n),
                    _sdpa(n, attn_mask=adjacency) if n <= 8192 else None)
    raise ValueError(f"unknown variant {name!r}")


VARIANTS = ["dot", "causal", "alibi", "window", "softcap", "segments", "cosine", "l2", "l1",
            "mahalanobis", "graph"]


def best_time(fn: Callable[[], object], repeat: int) -> float:
    """Minimum wall time over ``repeat`` runs after one warm-up (the minimum is the least
    disturbed by other load on a shared machine)."""
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def forward(attn: Callable, n: int) -> Callable[[], object]:
    q, k, v = _inputs(n)

    def run():
        with torch.no_grad():
            return attn(q, k, v)

    return run


def forward_backward(attn: Callable, n: int) -> Callable[[], object]:
    q, k, v = _inputs(n, requires_grad=True)
    grad = torch.randn(B, H, n, D, generator=torch.Generator().manual_seed(2))

    def run():
        attn(q, k, v).backward(grad)
        q.grad = k.grad = v.grad = None

    return run


def peak_extra_memory(fn: Callable[[], object]) -> float | None:
    """Peak resident memory above the level before ``fn``, in bytes (Linux only).

    Large allocations are forced onto mmap (M_MMAP_THRESHOLD = 64 KiB) so that freed
    tensors leave the resident set, and the kernel's high-water mark is reset first. That
    setting makes every later large allocation map fresh pages, which slows code that
    allocates per tile by up to 2x, so only a child process measures memory
    (``peak_in_child``); timings run with the default allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 1 << 16)
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _proc_status("VmRSS")
        fn()
        return _proc_status("VmHWM") - before
    except OSError:
        return None


def peak_in_child(name: str, n: int, backend: str) -> float | None:
    """Peak extra memory of one forward+backward of case ``name`` (a variant or a large-report
    case), measured in a fresh process after a warm-up call."""
    done = subprocess.run(
        [sys.executable, __file__, "--peak-of", name, str(n), backend],
        capture_output=True, text=True, check=False,
    )
    lines = done.stdout.split()
    return float(lines[-1]) if done.returncode == 0 and lines and lines[-1] != "None" else None


def _peak_of(name: str, n: int, backend: str) -> None:
    run = forward_backward(_qkv(case_kwargs(name, n), backend), n)
    run()  # warm-up: lazy initialisation stays out of the figure
    print(peak_extra_memory(run))


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise OSError(f"{key} not in /proc/self/status")


def _qkv(kwargs, backend="auto"):
    return lambda q, k, v: qkv.attention(q, k, v, backend=backend, **kwargs)


def _engine(kwargs, n: int, backend: str) -> str:
    from qkv.core.problem import build_problem
    from qkv.engines import plan

    q, k, v = _inputs(n)
    args = {"mask": None, "score_mod": None, "similarity": "dot", "scale": None, "metric": None,
            "dropout_p": 0.0, "return_weights": False, **kwargs}
    return plan(build_problem(q, k, v, **args), backend).engine


def _ratio(base: float | None, ours: float) -> float | None:
    return None if base is None else round(base / ours, 3)


def measure(name: str, n: int, repeat: int, backend: str, flex: bool) -> dict:
    """One row of the table: times in ms, peak MiB, and baseline time / qkv time."""
    case = make_case(name, n)
    ours = _qkv(case.kwargs, backend)
    fwd = best_time(forward(ours, n), repeat)
    fb = best_time(forward_backward(ours, n), repeat)
    mem = peak_in_child(name, n, backend)
    naive = _qkv(case.kwargs, "reference") if B * H * n * n * 4 * 6 <= DENSE_BUDGET else None
    naive_fwd = best_time(forward(naive, n), repeat) if naive else None
    naive_fb = best_time(forward_backward(naive, n), repeat) if naive else None
    flex_fwd = best_time(forward(case.flex, n), repeat) if flex and case.flex else None
    sdpa_fwd = best_time(forward(case.sdpa, n), repeat) if case.sdpa else None
    sdpa_fb = best_time(forward_backward(case.sdpa, n), repeat) if case.sdpa else None
    return {
        "report": "table", "variant": name if backend == "auto" else f"{name} ({backend})",
        "n": n, "engine": _engine(case.kwargs, n, backend), "fwd_ms": round(fwd * 1e3, 2),
        "fwd_bwd_ms": round(fb * 1e3, 2), "peak_mib": None if mem is None else round(mem / 2**20),
        "x_naive_fwd": _ratio(naive_fwd, fwd), "x_naive_fwd_bwd": _ratio(naive_fb, fb),
        "x_flex_fwd": _ratio(flex_fwd, fwd), "x_sdpa_fwd": _ratio(sdpa_fwd, fwd),
        "x_sdpa_fwd_bwd": _ratio(sdpa_fb, fb),
    }


HEADER = ["variant", "N", "engine", "fwd ms", "fwd+bwd ms", "peak MiB", "× naive fwd",
          "× naive f+b", "× flex fwd", "× sdpa fwd", "× sdpa f+b"]
COLUMNS = ["variant", "n", "engine", "fwd_ms", "fwd_bwd_ms", "peak_mib", "x_naive_fwd",
           "x_naive_fwd_bwd", "x_flex_fwd", "x_sdpa_fwd", "x_sdpa_fwd_bwd"]


def table_row(row: dict) -> list[str]:
    """A measured row as the markdown table prints it."""
    cells = []
    for key in COLUMNS:
        value = row[key]
        if value is None:
            cells.append("—")
        elif key.startswith("x_"):
            cells.append(f"{value:.2f}")
        elif isinstance(value, float):
            cells.append(f"{value:.0f}")
        else:
            cells.append(str(value))
    return cells


def print_row(row: list[str]) -> None:
    print("| " + " | ".join(row) + " |", flush=True)


def _dense_graph(n: int) -> torch.Tensor:
    edges = _graph_edges(n)
    adjacency = torch.zeros(n, n, dtype=torch.bool)
    adjacency[edges[1], edges[0]] = True
    return adjacency


# The --large report's cases: (label, qkv keyword arguments at N, backend).
LARGE_CASES = {
    "full": ("full dot (fused)", lambda n: {}, "fused"),
    "window": (f"sliding window {WINDOW}", lambda n: {"mask": qkv.sliding_window(WINDOW)},
               "auto"),
    "causal_alibi": ("causal + alibi", lambda n: {"mask": qkv.causal(),
                                                  "score_mod": qkv.alibi(H)}, "auto"),
    "segments4": ("segments (4 documents)",
                  lambda n: {"mask": qkv.segments(torch.arange(n) * 4 // n)}, "auto"),
    "graph_gather": ("graph, in-degree 16 (gather path)",
                     lambda n: {"mask": qkv.graph(_graph_edges(n), num_nodes=n)}, "auto"),
    "graph_dense": ("same graph as a dense mask (tiles)", lambda n: {"mask": _dense_graph(n)},
                    "fused"),
}


def case_kwargs(name: str, n: int) -> dict:
    """qkv keyword arguments of a benchmark variant or a --large case at sequence length n."""
    if name in WEIGHTING_CASES:
        return WEIGHTING_CASES[name]
    return LARGE_CASES[name][1](n) if name in LARGE_CASES else make_case(name, n).kwargs


def weightings_memory_report(n: int) -> list[dict]:
    """Peak extra memory of one forward+backward of each weighting on the fused engine at
    N=n, against softmax's (plain and causal), each in a fresh process."""
    print(f"\nWeightings, fused forward+backward at N={n}: peak extra memory (target within "
          "10% of softmax's)")
    base = {"dot": peak_in_child("dot", n, "fused"), "causal": peak_in_child("causal", n, "fused")}
    rows = []
    for label in ("dot", "causal", *WEIGHTING_CASES):
        mem = base.get(label) if label in base else peak_in_child(label, n, "fused")
        ref = base["causal" if "causal" in label else "dot"]
        ratio = None if mem is None or not ref else mem / ref
        print(f"  {label:24s} {'—' if mem is None else f'{mem / 2**20:.0f} MiB':>10s}  "
              f"{'' if ratio is None else f'{ratio:.2f}x softmax'}", flush=True)
        rows.append({"report": "weightings_memory", "variant": label, "n": n,
                     "peak_mib": None if mem is None else round(mem / 2**20),
                     "over_softmax": None if ratio is None else round(ratio, 3)})
    return rows


def large_report(repeat: int) -> list[dict]:
    """N=16384: sliding window and sparse graph against full / dense-masked attention, with
    the peak extra memory of each forward+backward. Full and dense-masked attention run once
    (about a minute each)."""
    n = 16384
    print(f"\nN={n} forward+backward (peak memory target <= 1024 MiB):")
    seconds, rows = {}, []
    for name, (label, kwargs, backend) in LARGE_CASES.items():
        run = forward_backward(_qkv(kwargs(n), backend), n)
        slow = name in ("full", "graph_dense")
        seconds[name] = _once(run) if slow or repeat < 2 else best_time(run, repeat - 1)
        mem = peak_in_child(name, n, backend)
        mib = "—" if mem is None else f"{mem / 2**20:.0f} MiB"
        print(f"  {label:38s} {seconds[name]:8.2f} s   peak extra {mib}", flush=True)
        rows.append({"report": "large", "case": label, "n": n, "fwd_bwd_s": round(seconds[name], 3),
                     "peak_mib": None if mem is None else round(mem / 2**20)})
    print(f"  window vs full: {seconds['full'] / seconds['window']:.1f}x faster (target >= 10x); "
          f"segments vs full: {seconds['full'] / seconds['segments4']:.1f}x (4 documents: "
          "ideal 4x)")
    print(f"  graph gather vs dense-masked: {seconds['graph_dense'] / seconds['graph_gather']:.0f}x"
          " faster (target >= 20x)")
    return rows


def _once(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def _paired_times(ours: Callable, direct: Callable, inputs, runs: int) -> list[tuple[float, float]]:
    pairs = []
    with torch.no_grad():
        ours(*inputs), direct(*inputs)
        for _ in range(runs):
            t0 = time.perf_counter()
            ours(*inputs)
            t1 = time.perf_counter()
            direct(*inputs)
            pairs.append((t1 - t0, time.perf_counter() - t1))
    return pairs


def dispatch_report(repeat: int) -> list[dict]:
    """qkv.attention's overhead on what it sends to SDPA: the same call timed both ways,
    alternating, so drifting load hits both alike; the median of the per-pair ratios."""
    print("\nDispatch overhead (qkv.attention -> SDPA versus calling SDPA directly), forward:")
    rows = []
    for n in (256, 1024, 4096):
        for label, kwargs, causal in (("dot", {}, False), ("causal", {"mask": qkv.causal()}, True)):
            pairs = _paired_times(
                _qkv(kwargs),
                lambda q, k, v, c=causal: F.scaled_dot_product_attention(q, k, v, is_causal=c),
                _inputs(n), max(repeat, 3) * (40 if n <= 1024 else 5),
            )
            ratio = sorted(a / b for a, b in pairs)[len(pairs) // 2]
            extra = sorted(a - b for a, b in pairs)[len(pairs) // 2]
            base = sorted(b for _, b in pairs)[len(pairs) // 2]
            print(f"  {label:6s} N={n:5d}: qkv/sdpa median {ratio:.3f} (target <= 1.05), "
                  f"median extra {extra * 1e6:+.0f} us on {base * 1e3:.2f} ms, "
                  f"{len(pairs)} pairs", flush=True)
            rows.append({"report": "dispatch", "variant": label, "n": n,
                         "qkv_over_sdpa_median": round(ratio, 4),
                         "extra_us_median": round(extra * 1e6, 1),
                         "sdpa_ms_median": round(base * 1e3, 3), "pairs": len(pairs)})
    return rows


# The user-defined L1 of docs/attention.md: the same math as similarity="l1", written as a
# per-dimension term, so the fused engine runs it through its generated C loops.
USER_L1 = qkv.Similarity(lambda q, k: -(q - k).abs(), name="user_l1")


def user_similarity_report(n: int, repeat: int) -> list[dict]:
    """Forward+backward of a user-defined L1 on the fused engine against the built-in L1 on
    the same engine, alternating (drifting load hits both alike), and against the
    materialized reference running the same user similarity (one run: it is slow)."""
    print(f"\nUser-defined L1 (f = -|q_d - k_d|) at N={n}, forward+backward:", flush=True)
    user = forward_backward(_qkv({"similarity": USER_L1}, "fused"), n)
    builtin = forward_backward(_qkv({"similarity": "l1"}, "fused"), n)
    user(), builtin()  # warm-up: the term's C loops are built (or found) here
    times: dict[str, list[float]] = {"user": [], "builtin": []}
    for _ in range(max(repeat, 3)):
        for label, run in (("user", user), ("builtin", builtin)):
            times[label].append(_once(run))
    ours, base = min(times["user"]), min(times["builtin"])
    print(f"  fused, user L1     {ours:8.2f} s", flush=True)
    print(f"  fused, built-in L1 {base:8.2f} s   user / built-in = {ours / base:.2f} "
          f"(target <= 3)", flush=True)
    forward_backward(_qkv({"similarity": USER_L1}, "reference"), 64)()  # first-call costs
    reference = _once(forward_backward(_qkv({"similarity": USER_L1}, "reference"), n))
    print(f"  reference, user L1 {reference:8.2f} s   reference / fused user = "
          f"{reference / ours:.2f} (target >= 3)", flush=True)
    return [{"report": "user_similarity", "n": n, "user_l1_s": round(ours, 3),
             "builtin_l1_s": round(base, 3), "reference_user_l1_s": round(reference, 3),
             "user_over_builtin": round(ours / base, 3)}]


# --vs-sdpa: the fused engine on every variant against SDPA's plain (and causal) attention.
VS_SDPA = ["dot", "causal", "cosine", "l2", "mahalanobis", "alibi", "l1", "softcap"]


# The weightings (qkv.weighting) on the fused engine: stick-breaking needs keys before each
# query, so it runs causal and is read against SDPA's causal time.
WEIGHTING_CASES = {
    "sigmoid": {"weighting": "sigmoid"},
    "relu": {"weighting": "relu"},
    "identity": {"weighting": "identity"},
    "user elementwise": {"weighting": qkv.weighting.elementwise(lambda s: s * torch.sigmoid(s))},
    "softpick": {"weighting": "softpick"},
    "stick_breaking causal": {"weighting": "stick_breaking", "mask": qkv.causal()},
}


def vs_sdpa_report(n: int, repeat: int) -> list[dict]:
    """Forward+backward of each variant on the fused engine as a multiple of SDPA's plain
    (and, for causal, causal) forward+backward. Each round runs every case once, each right
    after a run of its SDPA baseline, and the rounds repeat. Two readings: fastest against
    fastest (what drifting load over a whole round does not move), and the median of the
    per-pair ratios (what a slow spell of a few seconds does not move: it slows a case and
    the baseline run just before it alike)."""
    baselines = {"sdpa plain": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                 "sdpa causal": lambda q, k, v: F.scaled_dot_product_attention(q, k, v,
                                                                               is_causal=True)}
    cases = {}
    for name in VS_SDPA:
        cases[f"{name} (fused)" if name in ("dot", "causal") else name] = _qkv(
            make_case(name, n).kwargs, "fused")
    cases["user l1"] = _qkv({"similarity": USER_L1}, "fused")
    for label, kwargs in WEIGHTING_CASES.items():
        cases[label] = _qkv(kwargs, "fused")
    runs = {label: forward_backward(attn, n) for label, attn in {**baselines, **cases}.items()}
    times: dict[str, list[float]] = {label: [] for label in runs}
    paired: dict[str, list[float]] = {label: [] for label in cases}
    for run in runs.values():
        run()  # warm-up: C loops built, thread pool started
    for _ in range(max(repeat, 1)):
        for label in cases:
            base = "sdpa causal" if "causal" in label else "sdpa plain"
            times[base].append(_once(runs[base]))
            times[label].append(_once(runs[label]))
            paired[label].append(times[label][-1] / times[base][-1])
    best = {label: min(t) for label, t in times.items()}
    rounds = max(repeat, 1)
    print(f"\nFused engine, forward+backward, N={n}, {rounds} rounds (fastest; median of "
          "the ratios to the SDPA run just before):")
    print("| variant | fwd+bwd ms | × sdpa plain | × sdpa causal | × sdpa just before, median |")
    print("| --- | --- | --- | --- | --- |")
    rows = []
    for label, t in best.items():
        causal = t / best["sdpa causal"] if "causal" in label else None
        pair = sorted(paired[label])[len(paired[label]) // 2] if label in paired else None
        print(f"| {label} | {t * 1e3:.0f} | {t / best['sdpa plain']:.2f} | "
              f"{'—' if causal is None else f'{causal:.2f}'} | "
              f"{'—' if pair is None else f'{pair:.2f}'} |", flush=True)
        rows.append({"report": "vs_sdpa", "variant": label, "n": n, "rounds": rounds,
                     "fwd_bwd_ms": round(t * 1e3, 1),
                     "time_over_sdpa_plain": round(t / best["sdpa plain"], 3),
                     "time_over_sdpa_causal": None if causal is None else round(causal, 3),
                     "time_over_sdpa_paired_median": None if pair is None else round(pair, 3)})
    return rows


def causal_65536() -> list[dict]:
    n = 65536
    run = forward_backward(_qkv({"mask": qkv.causal()}, "fused"), n)
    start = time.perf_counter()
    mem = peak_extra_memory(run)
    seconds = time.perf_counter() - start
    print(f"\ncausal N={n} forward+backward (fused): {seconds:.1f} s, "
          f"peak extra memory {'—' if mem is None else f'{mem / 2**20:.0f} MiB'}")
    return [{"report": "causal_65536", "n": n, "fwd_bwd_s": round(seconds, 2),
             "peak_mib": None if mem is None else round(mem / 2**20)}]


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, nargs="+", default=[4096], help="sequence lengths")
    parser.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    parser.add_argument("--repeat", type=int, default=2, help="timed runs per cell (min taken)")
    parser.add_argument("--no-flex", action="store_true", help="skip compiled FlexAttention")
    parser.add_argument("--large", action="store_true", help="N=16384 window/graph/memory report")
    parser.add_argument("--causal-65536", action="store_true", help="causal fwd+bwd at N=65536")
    parser.add_argument("--dispatch", action="store_true", help="dispatch overhead over SDPA")
    parser.add_argument("--user-similarity", action="store_true",
                        help="a user-defined L1 against the built-in L1 and the reference")
    parser.add_argument("--vs-sdpa", action="store_true",
                        help="each variant's fused fwd+bwd as a multiple of SDPA's plain time")
    parser.add_argument("--no-table", action="store_true",
                        help="only the --large/--dispatch/--causal-65536/--user-similarity/"
                             "--vs-sdpa reports")
    parser.add_argument("--weightings-memory", action="store_true",
                        help="each weighting's peak memory at N=16384 against softmax's")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--peak-of", nargs=3, metavar=("CASE", "N", "BACKEND"),
                        help=argparse.SUPPRESS)  # the child process of peak_in_child
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.peak_of:
        name, n, backend = args.peak_of
        _peak_of(name, int(n), backend)
        return
    print(f"qkv CPU attention benchmark: B={B} H={H} D={D} float32, threads "
          f"{torch.get_num_threads()}, torch {torch.__version__}, {platform.processor() or ''} "
          f"{_cpu_model()} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    if not args.no_table:
        print_row(HEADER)
        print_row(["---"] * len(HEADER))
    rows = []
    for n in bar([] if args.no_table else args.n, desc="sequence lengths", unit="N"):
        for name in args.variants:
            rows.append(measure(name, n, args.repeat, "auto", not args.no_flex))
            print_row(table_row(rows[-1]))
            if name in ("dot", "causal"):  # the fused engine on what auto sends to SDPA
                rows.append(measure(name, n, args.repeat, "fused", False))
                print_row(table_row(rows[-1]))
    if args.dispatch:
        rows += dispatch_report(args.repeat)
    if args.user_similarity:
        for n in args.n:
            rows += user_similarity_report(n, args.repeat)
    if args.vs_sdpa:
        for n in args.n:
            rows += vs_sdpa_report(n, args.repeat)
    if args.large:
        rows += large_report(args.repeat)
    if args.weightings_memory:
        rows += weightings_memory_report(16384)
    if args.causal_65536:
        rows += causal_65536()
    if rows:
        write_results("attention_cpu", rows, B=B, H=H, D=D, dtype="float32",
                      repeat=args.repeat)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


if __name__ == "__main__":
    main()
