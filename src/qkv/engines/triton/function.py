"""Planning one call, launching the kernels, and the autograd Function around them.

Similarity = ``features`` (an O(N·D) torch map: identity, unit vectors for cosine, q Lᵀ for
Mahalanobis, differentiated by torch autograd) + a pairwise term fused in Triton: the kernels'
own code for the built-in terms (a ``TermKind``), else the term compiled from its definition
like masks and score modifiers (the kernelgen package). Gradients reach
q, k, v, a tensor scale, the metric (through ``features``) and every captured float tensor a
score modifier reads (ALiBi slopes, relative-bias tables, user tensors).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ...core.problem import Problem
from ...core.result import Result
from .. import ops
from ..kernelgen.graph import MAX_SLOTS, SLOT_INFO
from ..kernelgen.triton import load_module
from ..lowering import Lowered, TermKind, WeightsKind, lower, weights_kind
from . import backward, kernels, weighted, weighted_backward
from .blocks import BlockLayout, block_layout
from .groups import Code, Shape, Sizes, constants, mat
from .traced import TracedFunctions, trace_functions

_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


@dataclass(frozen=True)
class Tiles:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Tiling:
    """Tile shapes of the forward, dQ and dK/dV kernels; ``block_d`` chunks D for L1."""

    fwd: Tiles
    dq: Tiles
    dkv: Tiles
    block_d: int


def choose_tiling(kind: TermKind, d_pad: int, on_gpu: bool, element_bytes: int = 2) -> Tiling:
    """Tile shapes per term kind, padded head dim and element size. Not autotuned (the block
    tables are built for one tiling before launch). Each fits the 227 KiB of shared memory of
    an sm_90 block (test_triton_compile.py checks it with the bundled ptxas); the D = 128
    backward shapes are the fastest of those timed in docs/performance.md, "GPU: tiling"
    (benchmarks/triton_tiling.py), the rest are not timed."""
    if not on_gpu:  # the interpreter: small tiles, several per axis even on tiny tests
        small = Tiles(16, 16, 1, 1)
        return Tiling(small, small, small, min(d_pad, 64))
    if not TermKind(kind).products:  # CUDA cores, D in chunks
        return Tiling(Tiles(64, 32, 4, 2), Tiles(32, 32, 4, 2), Tiles(32, 32, 4, 2), 4)
    if d_pad <= 64:
        tiling = Tiling(Tiles(128, 128, 8, 3), Tiles(128, 64, 8, 3), Tiles(32, 64, 4, 2), d_pad)
    elif d_pad <= 128:
        # dK/dV works on transposed tiles: 128 keys by 64 queries with 8 warps, FlexAttention's
        # H100 choice, in 2 stages (3 overflow shared memory under masks), compiles without
        # spills, where a 64 x 64 tile with 4 warps spills and takes more instructions a pair.
        # dQ: 128 x 64 with 8 warps.
        tiling = Tiling(Tiles(128, 64, 8, 3), Tiles(128, 64, 8, 3), Tiles(64, 128, 8, 2), d_pad)
    else:
        tiling = Tiling(Tiles(64, 32, 8, 2), Tiles(32, 32, 8, 2), Tiles(32, 32, 8, 2), d_pad)
    if element_bytes <= 2:
        return tiling
    # fp32 tiles take twice the shared memory: at D = 128 the bf16 shapes would need nearly all
    # of the 227 KiB. Half the resident rows and two stages fit in half of it.
    return Tiling(*(Tiles(max(t.block_m // 2, 32), t.block_n, t.num_warps, min(t.num_stages, 2))
                    for t in (tiling.fwd, tiling.dq, tiling.dkv)), tiling.block_d)


def _functions(traced: TracedFunctions) -> tuple:
    """The generated Triton functions of a traced variant (its module is loaded once per
    source, ``load_module``), or the kernels' no-ops for the parts it lacks: mask_fn, mod_fn,
    mod_bwd_fn, term_fn, term_dq_fn, term_dk_fn, term_grad_fn."""
    module = load_module(traced.source)
    mod = (module.mod_fn, module.mod_bwd_fn) if traced.has_mod else (kernels.noop_mod,
                                                                       kernels.noop_mod_bwd)
    term = ((module.term_fn, module.term_dq_fn, module.term_dk_fn, module.term_grad_fn)
            if traced.has_term else (kernels.noop_term, kernels.noop_term, kernels.noop_term,
                                     kernels.noop_term_grad))
    return (module.mask_fn if traced.has_mask else kernels.noop_mask, *mod, *term)


@dataclass
class KernelPlan:
    traced: TracedFunctions
    functions: tuple  # the traced module's functions (``_functions``), looked up once
    kind: TermKind
    weights: WeightsKind
    eps: float  # softpick's
    include_self: bool  # stick-breaking's
    tiling: Tiling
    layout: BlockLayout  # tile states and block tables at the tiling's tiles
    nk: int
    offset: int
    precision: str
    dropout_p: float
    seed: int  # dropout's Philox seed, drawn from torch's generator once per call

    def table(self, t: Tiles, by_keys: bool = False) -> Tensor:
        """Key tiles per query tile for kernel tiles ``t`` (query tiles per key tile if
        ``by_keys``)."""
        return self.layout.table(t.block_m, t.block_n, by_keys)


def fine_tiles(tiling: Tiling) -> tuple[int, int]:
    """(rows, keys) of the smallest tiles of the three kernels: every kernel's tile states are
    coarsened from a classification at this size."""
    tiles = (tiling.fwd, tiling.dq, tiling.dkv)
    return min(t.block_m for t in tiles), min(t.block_n for t in tiles)


def make_plan(fq: Tensor, fk: Tensor, variant: Lowered, traced: TracedFunctions,
              dropout_p: float, seed: int) -> KernelPlan:
    """The launch plan for features fq (B, H, Nq, D) and fk (B, Hk, Nk, D): tilings and the
    block tables of the variant's mask (read here, at run time)."""
    mask, kind = variant.mask, variant.term
    batch, heads, nq = fq.shape[:3]
    nk = fk.shape[2]
    if mask is not None:
        mask.check(batch, heads, nq, nk)
    tiling = choose_tiling(kind, _pad(fq.shape[-1]), fq.is_cuda, fq.element_size())
    fine_m, fine_n = fine_tiles(tiling)
    weights = weights_kind(variant)
    return KernelPlan(
        traced=traced,
        functions=_functions(traced),
        kind=kind,
        weights=weights,
        eps=variant.normalizer.eps if weights == WeightsKind.SOFTPICK else 0.0,
        include_self=weights == WeightsKind.STICK and variant.normalizer.include_self,
        tiling=tiling,
        layout=block_layout(mask, batch, heads, nq, nk, fine_m, fine_n, fq.device),
        nk=nk,
        offset=nk - nq,
        precision="ieee" if fq.dtype == torch.float32 else "tf32",
        dropout_p=dropout_p,
        seed=seed,
    )


def _pad(d: int) -> int:
    return max(16, 1 << (d - 1).bit_length())


def _rows(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _slot_args(slots: list[Tensor], device) -> tuple[Tensor, ...]:
    """The kernels' SLOTS: the slot pointers (padded with a dummy), then their int64 info
    (strides, numel, bit length)."""
    info = [[0] * SLOT_INFO for _ in range(MAX_SLOTS)]
    for i, t in enumerate(slots):
        info[i][: t.dim()] = t.stride()
        info[i][4:6] = t.numel(), t.numel().bit_length()
    table = _info_on(tuple(v for row in info for v in row), torch.device(device))
    args = [t.view(torch.uint8) if t.dtype == torch.bool else t for t in slots]
    return (*args, *[table] * (MAX_SLOTS - len(args)), table)


@functools.lru_cache(maxsize=256)
def _info_on(values: tuple[int, ...], device: torch.device) -> Tensor:
    """The slot info on ``device``, copied once per layout: a copy from pageable host memory
    waits for the kernels queued before it, and every call would pay that wait. Read-only."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def row_dots(x: Tensor, y: Tensor) -> Tensor:
    """fp32 Σ_d x·y (B, H, N) of x and y (B, H, N, D), summed in fp32 in one pass over both."""
    batch, heads, n, d = x.shape
    out = torch.empty(batch, heads, n, dtype=torch.float32, device=x.device)
    block = 64
    kernels.row_dots_kernel[(-(-n // block), batch * heads)](
        mat(x), mat(y), out, heads, n, D=d, D_PAD=_pad(d), BLOCK=block, num_warps=4,
        num_stages=1)
    return out


def squared_norms(plan: KernelPlan, q: Tensor, k: Tensor, dummy: Tensor) -> tuple[Tensor, Tensor]:
    """fp32 ‖q‖² (B, H, Nq) and ‖k‖² (B, Hkv, Nk) for SQDIST, whose kernels read them (once
    per call, not once per tile); ``dummy`` twice for the other terms, which read neither."""
    if plan.kind != TermKind.SQDIST:
        return dummy, dummy
    return row_dots(q, q), row_dots(k, k)


def _shape(plan: KernelPlan, t: Tiles, q: Tensor, k: Tensor, v: Tensor) -> Shape:
    return constants(
        Shape, GROUP=q.shape[1] // k.shape[1], D=q.shape[3], DV=v.shape[3], D_PAD=_pad(q.shape[3]),
        DV_PAD=_pad(v.shape[3]), BLOCK_M=t.block_m, BLOCK_N=t.block_n,
        BLOCK_D=plan.tiling.block_d, PRECISION=plan.precision,
    )


def _code(plan: KernelPlan, slot_grad: bool = False, scale_grad: bool = False) -> Code:
    var = plan.traced
    mask_fn, mod_fn, mod_bwd_fn, term_fn, term_dq_fn, term_dk_fn, term_grad_fn = plan.functions
    return constants(
        Code, KIND=plan.kind.value, PRODUCTS=plan.kind.products, HAS_MASK=var.has_mask,
        MASK_FN=mask_fn, HAS_MOD=var.has_mod, MOD_FN=mod_fn, MOD_BWD_FN=mod_bwd_fn,
        TERM_FN=term_fn, TERM_DQ_FN=term_dq_fn, TERM_DK_FN=term_dk_fn,
        TERM_GRAD_FN=term_grad_fn, DROPOUT=plan.dropout_p > 0, SLOT_GRAD=slot_grad,
        SCALE_GRAD=scale_grad, WEIGHTS=plan.weights.value, EPS=plan.eps,
        INCLUDE_SELF=plan.include_self,
    )


def _sizes(plan: KernelPlan, q: Tensor, k: Tensor) -> Sizes:
    return Sizes(q.shape[1], q.shape[2], k.shape[2], plan.offset, plan.seed, plan.dropout_p)


def _launch(kernel, t: Tiles, blocks: int, rows: int, *args) -> None:
    """``kernel`` on a grid of ``blocks`` tiles by ``rows`` (batch, head) pairs."""
    kernel[(blocks, rows)](*args, num_warps=t.num_warps, num_stages=t.num_stages)


def attention_forward(plan: KernelPlan, q, k, v, scale, slots) -> tuple[Tensor, Tensor]:
    """out (B, H, Nq, Dv) and base-2 lse (B, H, Nq) (+inf for rows with no key); for another
    weighting, its statistic in base 2 (``weighted.fwd_kernel``)."""
    batch, heads, nq, _ = q.shape
    out = torch.empty(batch, heads, nq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, nq, dtype=torch.float32, device=q.device)
    t = plan.tiling.fwd
    kernel = kernels.fwd_kernel if plan.weights == WeightsKind.SOFTMAX else weighted.fwd_kernel
    _launch(kernel, t, -(-nq // t.block_m), batch * heads,
            mat(q), mat(k), mat(v), mat(out), lse, scale, mat(plan.table(t)),
            squared_norms(plan, q, k, scale), _slot_args(slots, q.device), _sizes(plan, q, k),
            _shape(plan, t, q, k, v), _code(plan))
    return out, lse


def attention_weights(plan: KernelPlan, q, k, lse, scale, slots) -> Tensor:
    """The weights (B, H, Nq, Nk) that multiplied v, recomputed from the base-2 lse (the
    statistic of another weighting)."""
    batch, heads, nq, _ = q.shape
    weights = torch.zeros(batch, heads, nq, k.shape[2], dtype=q.dtype, device=q.device)
    t = plan.tiling.fwd
    softmax = plan.weights == WeightsKind.SOFTMAX
    kernel = kernels.weights_kernel if softmax else weighted.weights_kernel
    _launch(kernel, t, -(-nq // t.block_m), batch * heads,
            mat(q), mat(k), mat(weights), lse, scale, mat(plan.table(t)),
            squared_norms(plan, q, k, scale), _slot_args(slots, q.device), _sizes(plan, q, k),
            _shape(plan, t, q, k, k), _code(plan))
    return weights


def attention_backward(plan: KernelPlan, q, k, v, scale, out, lse, grad_out, slots,
                       need_scale: bool, need_slots: set[int], grad_lse: Tensor | None = None):
    """dq, dk, dv (input dtypes), dscale (H,) fp32 and fp32 gradients of the slots in
    ``need_slots`` (None elsewhere). ``grad_lse`` is the gradient of the base-2 lse, if
    anything read it: d lse / d score = p, so it joins delta (in natural units). Only
    softmax's lse has a reader (``build_problem`` refuses one for another weighting).
    Stick-breaking's dK and dV are added by the query tiles (``weighted_backward``), into
    fp32 zeros."""
    batch, heads, nq, _ = q.shape
    kv_heads, nk = k.shape[1], k.shape[2]
    grad_out = _rows(grad_out)
    delta = row_dots(grad_out, out)
    if grad_lse is not None:
        delta = (delta - grad_lse.float() * _LOG2E).contiguous()
    # Each program stores its rows of dq, dk (product terms) and dv once, in the inputs'
    # dtype; the chunked terms' loops add into fp32 dq and dk tile by tile.
    stick = plan.weights == WeightsKind.STICK
    stored = plan.kind.products
    dq, dk = (torch.empty(x.shape, dtype=x.dtype, device=x.device) if stored and not added
              else torch.zeros(x.shape, dtype=torch.float32, device=x.device)
              for x, added in ((q, False), (k, stick)))
    dv_shape = (batch, kv_heads, nk, v.shape[3])
    dvv = (torch.zeros(dv_shape, dtype=torch.float32, device=q.device) if stick
           else torch.empty(dv_shape, dtype=v.dtype, device=q.device))
    dscale = torch.zeros(heads, dtype=torch.float32, device=q.device)
    slot_args = _slot_args(slots, q.device)
    grads = [
        torch.zeros(t.shape, dtype=torch.float32, device=q.device) if i in need_slots else None
        for i, t in enumerate(slots)
    ]
    grad_args = [g if g is not None else dscale for g in grads]
    grad_args = (*grad_args, *[dscale] * (MAX_SLOTS - len(grad_args)))
    inputs = (mat(q), mat(k), mat(v), mat(grad_out), lse, delta, scale)
    norms, sizes = squared_norms(plan, q, k, dscale), _sizes(plan, q, k)
    softmax = plan.weights == WeightsKind.SOFTMAX
    if not stick:
        t = plan.tiling.dkv
        _launch(backward.bwd_kv_kernel if softmax else weighted_backward.bwd_kv_kernel, t,
                -(-nk // t.block_n), batch * kv_heads,
                *inputs, mat(plan.table(t, by_keys=True)), norms, dk, dvv, slot_args, sizes,
                _shape(plan, t, q, k, v), _code(plan))
    t = plan.tiling.dq
    outputs = (dq, dscale) if softmax else (dq, dk, dvv, dscale)
    _launch(backward.bwd_q_kernel if softmax else weighted_backward.bwd_q_kernel, t,
            -(-nq // t.block_m), batch * heads,
            *inputs, mat(plan.table(t)), norms, *outputs, slot_args, grad_args, sizes,
            _shape(plan, t, q, k, v), _code(plan, bool(need_slots), need_scale))
    return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), dscale, grads


def _prepare(fq: Tensor, fk: Tensor, variant: Lowered, dropout_p: float,
             seed: int) -> KernelPlan:
    """Trace the variant's Triton functions (or find them traced) and plan the launch."""
    traced = trace_functions(variant, fq.device, fq.shape[-1], max(fq.shape[2], fk.shape[2]))
    return make_plan(fq, fk, variant, traced, dropout_p, seed)


def _kernel_forward(fq, fk, v, variant: Lowered, dropout_p, want_weights):
    seed = int(torch.randint(0, 2**30, ())) if dropout_p > 0 else 0  # dropout's Philox seed
    plan = _prepare(fq, fk, variant, dropout_p, seed)
    slots = plan.traced.slots
    scale = scale_per_head(variant.scale, fq.shape[1], fq.device)
    out, lse = attention_forward(plan, fq, fk, v, scale, slots)
    weights = attention_weights(plan, fq, fk, lse, scale, slots) if want_weights else None
    return out, lse, weights, seed


def _kernel_backward(dout, dlse, fq, fk, v, out, lse, seed, variant: Lowered, dropout_p,
                     wanted):
    with torch.enable_grad():  # a slot copied from a wanted tensor keeps its graph
        plan = _prepare(fq, fk, variant, dropout_p, seed)
    slots, scale = plan.traced.slots, variant.scale
    need_scale = any(t is scale for t in wanted)
    need_slots = {i for i in plan.traced.grad_slots if slots[i].requires_grad}
    dq, dk, dv, dscale, grads = attention_backward(
        plan, fq, fk, v, scale_per_head(scale, fq.shape[1], fq.device), out, lse, dout, slots,
        need_scale, need_slots, dlse)
    extras = ([scale] if need_scale else []) + [slots[i] for i in sorted(need_slots)]
    dextras = ([dscale] if need_scale else []) + [grads[i] for i in sorted(need_slots)]
    return dq, dk, dv, ops.grads_of_wanted(wanted, extras, dextras)


KERNELS = ops.EngineKernels(
    _kernel_forward, _kernel_backward,
    lse_like=lambda fq: fq.new_empty(*fq.shape[:3], dtype=torch.float32),
)
OP = ops.define("triton", KERNELS)


def scale_per_head(scale: float | Tensor, heads: int, device) -> Tensor:
    """The kernels' scale argument, an fp32 (H,) tensor: a float filled, ``Lowered``'s (H,)
    tensor as it is (its gradient is the kernels' dscale)."""
    if isinstance(scale, Tensor):
        return scale
    return torch.full((heads,), float(scale), dtype=torch.float32, device=device)


def natural_lse(lse2: Tensor) -> Tensor:
    """The kernels' base-2 lse (+inf on rows with no key) -> natural units, -inf there."""
    return torch.where(lse2 == float("inf"), float("-inf"), lse2 * _LN2)


def run(p: Problem) -> Result:
    """Attention for a problem the engine accepts (see ``plan``), with the weights recomputed
    from the saved log-sum-exp (no gradient) when asked. The features stay in the inputs'
    dtype and the scale stays out of them: the kernels apply it in fp32, with log2(e)."""
    fq, fk, v, variant = lower(p, inputs_dtype=True, fold_scale=False)
    out, lse, weights = OP.run(_rows(fq), _rows(fk), _rows(v), variant, p.dropout_p,
                               p.return_weights)
    return Result(out, natural_lse(lse), weights)
