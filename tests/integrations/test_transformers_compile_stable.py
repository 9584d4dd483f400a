"""transformers' test_static_cache_no_recompile_with_smaller_length on the models whose masks
are compositions (sliding windows, sinks, softcaps): static-cache generation, its decoding
forward compiled with fullgraph, then a second, shorter prompt that must not recompile."""

import pytest
import torch
import transformers as tf
from transformers import masking_utils as hf

from qkv.integrations.transformers import mask_function

from .test_transformers_models import build


def prompts(lengths):
    """A batch of 2 per length, the second row left-padded by 2, so that padding is in play."""
    batch = []
    for n in lengths:
        ids = torch.randint(1, 50, (2, n), generator=torch.Generator().manual_seed(n))
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        batch.append((ids, mask))
    return batch


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gpt_oss"])
def test_a_shorter_prompt_does_not_recompile(name):
    """A window of 12 over a cache of 15 (10 + 5 new tokens): the first prompt fills it after
    two steps, the second never does, so that the sliding layers' offsets and lengths take
    both forms (transformers' own tests use windows longer than the cache)."""
    model = build(name, sliding_window=12)
    model.set_attn_implementation("qkv")
    config = tf.CompileConfig(fullgraph=True, backend="eager")
    config._compile_all_devices = True  # generate compiles on GPUs only unless told
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0,
                  cache_implementation="static")
    torch._dynamo.reset()
    (long_ids, long_mask), (short_ids, short_mask) = prompts((10, 6))
    outputs = [model.generate(long_ids, attention_mask=long_mask, compile_config=config,
                              **kwargs)]
    with torch.compiler.set_stance("fail_on_recompile"):
        outputs.append(model.generate(short_ids, attention_mask=short_mask,
                                      compile_config=config, **kwargs))
    model.set_attn_implementation("eager")
    for (ids, mask), out in zip(((long_ids, long_mask), (short_ids, short_mask)), outputs,
                                strict=True):
        ref = model.generate(ids, attention_mask=mask, disable_compile=True, **kwargs)
        assert torch.equal(out, ref)


def test_a_decoding_steps_mask_has_the_same_structure_at_every_step():
    """What dynamo guards on: the mask's types and Python numbers. A one-query step on a
    static cache (transformers withholds allow_is_causal_skip) keeps both whatever the offsets
    and the padding: the per-key mask for padding, and the offsets' shift as a tensor."""
    window = hf.sliding_window_causal_mask_function(4)

    def structure(q_offset, kv_offset, kv_length, keep):
        mask = mask_function(2, 1, kv_length, q_offset, kv_offset, mask_function=window,
                             attention_mask=keep, allow_is_causal_skip=False).mask
        assert isinstance(mask.shift, torch.Tensor)
        assert mask.shift.item() == q_offset - kv_offset
        return type(mask), repr(mask.inner)

    full = torch.ones(2, 12, dtype=torch.bool)
    left_padded = full.clone()
    left_padded[1, :3] = False
    steps = [structure(q, max(q - 3, 0), 4, keep) for q in (3, 5, 9)
             for keep in (full[:, :q + 1], left_padded[:, :q + 1])]
    assert len(set(steps)) == 1, steps

