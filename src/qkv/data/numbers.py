"""German number words -> English number words, generated with ``num2words``.

"zweiundvierzig" -> "forty-two": the order of the digits flips between the languages, so
cross-attention has to learn to reorder. The held-out numbers are drawn first, uniformly
from 0..999,999 (so most have six digits, the longest phrases). The training numbers never
repeat them; they are drawn with a uniform number of digits (1 to 6), then uniformly within
that digit count, so the small building blocks are common in training.
"""

from __future__ import annotations

import random

MAX_NUMBER = 999_999


def german(n: int) -> str:
    from num2words import num2words

    return num2words(n, lang="de")


def english(n: int) -> str:
    from num2words import num2words

    return num2words(n, lang="en")


def sample_numbers(
    count: int, rng: random.Random, exclude: set[int], by_digits: bool = True
) -> list[int]:
    """``count`` distinct numbers in [0, MAX_NUMBER], none in ``exclude``: with a uniform
    digit count (``by_digits``), or uniform over all numbers."""
    if count + len(exclude) > MAX_NUMBER // 2:
        raise ValueError(f"count: at most {MAX_NUMBER // 2 - len(exclude)} numbers, got {count}")
    chosen: list[int] = []
    seen = set(exclude)
    while len(chosen) < count:
        if by_digits:
            digits = rng.randint(1, 6)
            n = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)
        else:
            n = rng.randint(0, MAX_NUMBER)
        if n not in seen:
            seen.add(n)
            chosen.append(n)
    return chosen


def split_numbers(n_train: int, n_test: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """Deterministic (train, held-out) numbers that share no number."""
    rng = random.Random(seed)
    test = sample_numbers(n_test, rng, set(), by_digits=False)
    return sample_numbers(n_train, rng, set(test)), test


def pairs(numbers: list[int]) -> list[tuple[str, str]]:
    """(German words, English words) of each number."""
    return [(german(n), english(n)) for n in numbers]


def number_splits(
    n_train: int, n_test: int, seed: int = 0
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Deterministic (German, English) pairs: ``n_train`` for training, ``n_test`` held out.

    The two splits share no number; the same arguments always give the same pairs.
    """
    train, test = split_numbers(n_train, n_test, seed)
    return pairs(train), pairs(test)
