"""Shared helpers for the attention tests, and the user-defined similarities of
docs/attention.md, registered so that every test that walks the registry runs them."""

import pytest
import torch

import qkv
from qkv.core.similarity import SIMILARITIES

# Per-dimension weights for head dim D = 4 and a temperature, both
# learnable; float64 so that gradcheck can perturb them (the term promotes, engines cast back).
EXAMPLE_D = 4
L1_WEIGHT = torch.linspace(0.5, 1.5, EXAMPLE_D, dtype=torch.float64).requires_grad_()
TAU = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)

EXAMPLES = {
    "p3": qkv.Similarity(lambda q, k: -(q - k).abs() ** 3, name="p3"),
    "weighted_l1": qkv.Similarity(lambda q, k: -L1_WEIGHT * (q - k).abs(), name="weighted_l1"),
    "laplacian": qkv.Similarity(lambda q, k: -(q - k).abs() / TAU, scale=1.0, name="laplacian"),
}
for _name, _sim in EXAMPLES.items():
    qkv.register_similarity(_name, _sim)


def registered_similarities(d: int = EXAMPLE_D) -> list[str]:
    """Every registered similarity that applies to head dim d (a per-dimension weight fixes D)."""
    return [name for name, sim in SIMILARITIES.items()
            if all(t.dim() == 0 or t.shape[-1] == d for t in sim.tensors())]


def similarity_inputs(name: str, heads: int, d: int, dtype=torch.float64, seed=2):
    """(metric or None, learnable tensors) for a registered similarity: Mahalanobis' metric
    (H, D, D) and the tensors a user's term reads; all are gradient targets."""
    metric = None
    if SIMILARITIES[name].needs_metric:
        g = torch.Generator().manual_seed(seed)
        metric = (torch.eye(d, dtype=dtype) + 0.3 * torch.randn(heads, d, d, generator=g,
                                                                 dtype=dtype)).requires_grad_()
    learnable = [metric] if metric is not None else []
    return metric, learnable + list(SIMILARITIES[name].tensors())


def rel_err(a, b) -> float:
    """‖a - b‖ / ‖b‖ in float64, for tensors that may need gradients."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def rand_qkv(
    b=2, h=4, hkv=2, nq=5, nk=7, d=6, dv=3, dtype=torch.float64, requires_grad=False, seed=0
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, nq, d, generator=g, dtype=dtype)
    k = torch.randn(b, hkv, nk, d, generator=g, dtype=dtype)
    v = torch.randn(b, hkv, nk, dv, generator=g, dtype=dtype)
    for t in (q, k, v):
        t.requires_grad_(requires_grad)
    return q, k, v


def mask_cases(b, nq, nk):
    """One instance of every mask kind for a (b, ., nq, nk) problem, including fully masked rows."""
    g = torch.Generator().manual_seed(1)
    dense = torch.rand(b, 1, nq, nk, generator=g) > 0.4
    dense[0, 0, 0] = False  # a row with no allowed key
    edges = torch.stack(
        [torch.randint(0, nk, (3 * nq,), generator=g), torch.randint(0, nq, (3 * nq,), generator=g)]
    )
    adjacency = torch.rand(nq, nk, generator=g) > 0.6
    q_ids = torch.tensor([[0] * (nq // 2) + [1] * (nq - nq // 2)] * b)
    kv_ids = torch.tensor([[0] * (nk // 3) + [1] * (nk - nk // 3)] * b)
    return {
        "none": None,
        "causal": qkv.causal(),
        "sliding": qkv.sliding_window(2, 1),
        "padding": qkv.padding(torch.tensor([nk, 0] + [nk - 1] * (b - 2))[:b]),
        "segments": qkv.segments(q_ids, kv_ids),
        "graph_edges": qkv.graph(edges),
        "graph_adjacency": qkv.graph(adjacency),
        "bool_tensor": dense,
        "combined": (qkv.causal() | qkv.sliding_window(0, 2))
        & qkv.padding(torch.tensor([nk - 2] * b)),
        "custom_not": qkv.custom_mask(lambda b, h, q, kv: (q + kv + h) % 3 != 1) | ~qkv.causal(),
    }


def mask_kinds(mask) -> set[type]:
    """The mask classes a mask is built of (combinations included)."""
    found = {type(mask)}
    for child in (getattr(mask, "a", None), getattr(mask, "b", None),
                  getattr(mask, "inner", None)):
        if isinstance(child, qkv.Mask):
            found |= mask_kinds(child)
    return found


@pytest.fixture
def qkv_f64():
    return rand_qkv()


@pytest.fixture
def one_thread():
    """Tiny tiles are many tiny ops; on a shared 2-core machine one thread runs them fastest."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
