"""qkv.interp's interventions against the same interventions on a hand-written eager GPT in
float64: ablation, patching of z, patterns and the residual stream, attention × gradient
and the logit lens."""

import pytest
import torch

from qkv import interp
from qkv.models import GPT, GPTConfig

from .eager import eager_gpt


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=40, block_size=32, n_layer=3,
                       block={"d_model": 32, "n_head": 4})
    return GPT(config).double().eval()


CLEAN = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(2))
CORRUPTED = CLEAN.clone()
CORRUPTED[:, 2] = (CLEAN[:, 2] + 7) % 40


def metric(logits):
    return logits[:, -1, 5].sum() - logits[:, -1, 9].sum()


@pytest.mark.parametrize("mode", ["zero", "mean"])
def test_ablate(model, mode):
    def edit(heads):
        def fn(z):
            z = z.clone()
            z[:, :, heads] = 0 if mode == "zero" else z[:, :, heads].mean(1, keepdim=True)
            return z
        return fn

    want = eager_gpt(model, CLEAN, edits={(0, "z"): edit([1]), (2, "z"): edit([0, 3])})
    with interp.ablate(model, heads=[(0, 1), (2, 0), (2, 3)], mode=mode):
        got = model(CLEAN)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(model(CLEAN), eager_gpt(model, CLEAN), rtol=0, atol=1e-12)


def _eager_patch(model, short, width, take):
    clean = {}
    eager_gpt(model, CLEAN, seen=clean)
    grid = torch.zeros(len(model.blocks), width, dtype=torch.float64)
    for layer in range(len(model.blocks)):
        for i in range(width):
            def fn(t, layer=layer, i=i):
                t = t.clone()
                take(t, clean[(layer, short)], i)
                return t
            grid[layer, i] = metric(eager_gpt(model, CORRUPTED, edits={(layer, short): fn}))
    return grid


def _heads(t, source, i):
    t[:, :, i] = source[:, :, i]


def _pattern_heads(t, source, i):
    t[:, i] = source[:, i]


@pytest.mark.parametrize(("what", "short", "take"), [
    ("z", "z", _heads), ("pattern", "pattern", _pattern_heads), ("resid", "resid_pre", None)])
def test_patch(model, what, short, take):
    width = CLEAN.shape[1] if what == "resid" else 4
    with torch.no_grad():
        want = _eager_patch(model, short, width, take or _pattern_heads)
    got = interp.patch(model, CLEAN, CORRUPTED, what=what, metric=metric)
    assert got.shape == (3, width)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    some = interp.patch(model, CLEAN, CORRUPTED, what=what, metric=metric, layers=[2, 0])
    torch.testing.assert_close(some, want[[2, 0]], rtol=0, atol=1e-10)
    # Patching from the corrupted run itself changes nothing.
    same = interp.patch(model, CORRUPTED, CORRUPTED, what=what, metric=metric)
    with torch.no_grad():
        corrupted = float(metric(model(CORRUPTED)))
    torch.testing.assert_close(same, torch.full_like(same, corrupted),
                               rtol=0, atol=1e-10)


def test_attribution(model):
    seen = {}

    def retained(w):
        w.retain_grad()
        return w

    edits = {(layer, "pattern"): retained for layer in range(3)}
    metric(eager_gpt(model, CLEAN, edits=edits, seen=seen)).backward()
    want = torch.stack([seen[(layer, "pattern")].detach() * seen[(layer, "pattern")].grad
                        for layer in range(3)])
    got = interp.attribution(model, CLEAN, metric)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    part = interp.attribution(model, CLEAN, metric, layers=[1], heads=[2], rows=(3, 8))
    torch.testing.assert_close(part, want[1:2, :, 2:3, 3:8], rtol=0, atol=1e-12)
    # Without parameter gradients the patterns become leaves: the same numbers.
    model.requires_grad_(False)
    try:
        frozen = interp.attribution(model, CLEAN, metric)
    finally:
        model.requires_grad_(True)
    torch.testing.assert_close(frozen, want, rtol=0, atol=1e-12)


def test_logit_lens(model):
    seen = {}
    eager_gpt(model, CLEAN, seen=seen)
    lens = interp.logit_lens(model, CLEAN, positions=-1)
    assert lens.shape == (3, 2, 1, 40)
    for layer in range(3):
        x = seen[(layer, "resid_post")][:, -1:]
        want = model.lm_head(model.norm(x))
        torch.testing.assert_close(lens[layer], want, rtol=0, atol=1e-12)
    torch.testing.assert_close(interp.logit_lens(model, CLEAN)[-1], model(CLEAN),
                               rtol=0, atol=1e-12)


def test_errors_name_the_argument(model):
    with pytest.raises(ValueError, match="mode must be"):
        with interp.ablate(model, heads=[(0, 0)], mode="resample"):
            pass
    with pytest.raises(ValueError, match="layer must be an int in 0..2"):
        with interp.ablate(model, heads=[(3, 0)]):
            pass
    with pytest.raises(ValueError, match="heads \\[4\\] are out of range"):
        with interp.ablate(model, heads=[(0, 4)]):
            model(CLEAN)
    with pytest.raises(ValueError, match="what must be one of"):
        interp.patch(model, CLEAN, CORRUPTED, what="mlp", metric=metric)
    with pytest.raises(ValueError, match="one shape"):
        interp.patch(model, CLEAN, CORRUPTED[:, :5], metric=metric)
    with pytest.raises(TypeError, match="qkv model with hooks"):
        interp.attribution(torch.nn.Linear(2, 2), CLEAN, metric)
