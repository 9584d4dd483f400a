import random

import pytest

from qkv.data.numbers import MAX_NUMBER, german, number_splits, sample_numbers, split_numbers


def test_the_digits_swap_between_the_languages():
    assert german(42) == "zweiundvierzig"
    assert number_splits(0, 0) == ([], [])
    assert (german(999_999), MAX_NUMBER) == (
        "neunhundertneunundneunzigtausendneunhundertneunundneunzig", 999_999)


def test_splits_are_deterministic_and_share_no_number():
    train, test = split_numbers(3000, 300, seed=5)
    assert (train, test) == split_numbers(3000, 300, seed=5)
    assert split_numbers(3000, 300, seed=6) != (train, test)
    assert not set(train) & set(test)
    assert len(set(train)) == 3000 and len(set(test)) == 300
    assert all(0 <= n <= MAX_NUMBER for n in train + test)
    assert {len(str(n)) for n in train} == {1, 2, 3, 4, 5, 6}  # small numbers train
    assert sum(n >= 100_000 for n in test) > 250  # held out: uniform up to 999,999


def test_pairs_are_german_then_english():
    train, test = number_splits(5, 3, seed=1)
    numbers_train, numbers_test = split_numbers(5, 3, seed=1)
    assert [p[0] for p in test] == [german(n) for n in numbers_test]
    assert len(train) == 5 and all(isinstance(e, str) for _, e in train)


def test_too_many_numbers_is_refused():
    with pytest.raises(ValueError, match="count"):
        sample_numbers(MAX_NUMBER, random.Random(0), set())
