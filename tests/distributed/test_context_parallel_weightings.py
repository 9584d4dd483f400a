"""context_parallel_attention under every weighting on 2 and 3 gloo ranks equals one
process's qkv.attention(..., weighting=...) in float64, outputs and gradients."""

import pytest

from .launch import run_ranks, values
from .weightings import compare, refused, variants

# N = 60 divides into 2P pieces for P = 2, 3; rows of 8 make several query runs and key
# pieces per chunk (ragged at each chunk's end), so the stick and the maxima cross pieces too.
N, ROWS = 60, 8


@pytest.mark.slow  # 30-100 s on two busy cores: ten weightings, rows of 8, P ranks
@pytest.mark.parametrize("world, layout", [(2, "contiguous"), (3, "zigzag")])
def test_every_weighting_matches_one_process(world, layout):
    """Two ranks in pieces, and three in the zigzag layout (whose pieces hold both ends of
    the sequence): the two cover every rule of the merge; the suite's time allows two."""
    names = list(variants(N))
    for rank, errors in enumerate(values(run_ranks(compare, world, layout, N, names, ROWS))):
        for name, (out_err, grad_err) in errors.items():
            assert out_err < 1e-12 and grad_err < 1e-11, (rank, name, out_err, grad_err)


def test_whole_shards_in_one_piece_match_one_process():
    """The default rows: one query run and one key piece per chunk."""
    names = ["sigmoid_bias", "softpick", "stick"]
    for rank, errors in enumerate(values(run_ranks(compare, 2, "zigzag", N, names))):
        for name, (out_err, grad_err) in errors.items():
            assert out_err < 1e-12 and grad_err < 1e-11, (rank, name, out_err, grad_err)


def test_refused_weightings_give_every_rank_one_error():
    expected = {"user_max_sum": "halved", "sinks": "sinks add a logit",
                "stick_unmasked": "pass mask=qkv.causal()", "stick_window": "later key",
                "bias_heads": "bias for 3 heads"}
    first, second = values(run_ranks(refused, 2, list(expected), timeout=60))
    for case, words in expected.items():
        assert first[case] == second[case] and words in first[case], (case, first[case])
