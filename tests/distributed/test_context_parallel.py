"""context_parallel_attention on 2 and 3 gloo ranks equals one process's qkv.attention."""

import pytest

from .cases import compare, disagree, variants
from .launch import run_ranks, values

# N = 300 is not a multiple of the engines' blocks, and divides into 2P pieces for P = 2, 3.
N = 300


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [2, 3])
def test_every_variant_matches_one_process(world, layout):
    names = list(variants(N))
    for rank, errors in enumerate(values(run_ranks(compare, world, layout, N, names))):
        for name, (out_err, grad_err) in errors.items():
            assert out_err < 1e-5 and grad_err < 1e-4, (rank, name, out_err, grad_err)


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_keys_and_values_in_many_pieces_match_one_process(layout):
    """Pieces of 32 rows (ragged at the end of each chunk): each goes round the ring on its
    own, with its dK, dV, and several pieces of every shard meet every query run."""
    names = ["causal_l1_alibi", "graph", "sinks"]
    for rank, errors in enumerate(values(run_ranks(compare, 2, layout, N, names, 32))):
        for name, (out_err, grad_err) in errors.items():
            assert out_err < 1e-5 and grad_err < 1e-4, (rank, name, out_err, grad_err)


def test_disagreeing_ranks_all_get_one_clear_error():
    expected = {"shapes": "disagree on q", "variant": "disagree on similarity",
                "invalid": "rank 1: segments"}
    first, second = values(run_ranks(disagree, 2, list(expected), timeout=60))
    for case, words in expected.items():
        assert first[case] == second[case] and words in first[case], (case, first[case])
