"""Loaders for the user's files: a TSV of sentence pairs and a UTF-8 text file."""

from __future__ import annotations

import random
from pathlib import Path

from .errors import DataError


def read_nonempty_text(path: str | Path, what: str) -> str:
    """The file's UTF-8 text; a DataError for a missing, unreadable, non-UTF-8 or empty file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{what} {str(path)!r} does not exist or is not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{what} {str(path)!r} is not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DataError(f"{what} {str(path)!r} cannot be read: {e.strerror}") from None
    if not text.strip():
        raise DataError(f"{what} {str(path)!r} is empty")
    return text


def read_pairs_tsv(path: str | Path) -> list[tuple[str, str]]:
    """Sentence pairs from a TSV file: one ``source<TAB>target`` per line; blank lines skipped."""
    text = read_nonempty_text(path, "TSV file")
    pairs = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise DataError(f"TSV file {str(path)!r} line {number} has no tab: {line[:60]!r}")
        source, target = line.split("\t", 1)
        if not source.strip() or not target.strip():
            raise DataError(f"TSV file {str(path)!r} line {number} has an empty side")
        pairs.append((source.strip(), target.strip()))
    return pairs


def read_text_file(path: str | Path) -> str:
    return read_nonempty_text(path, "text file")


def split_pairs(
    pairs: list[tuple[str, str]], test_fraction: float, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """A fixed, seeded split of the user's pairs into (train, held-out); at least one of each."""
    if len(pairs) < 2:
        raise DataError(f"need at least 2 sentence pairs to split train/held-out, got {len(pairs)}")
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    n_test = min(len(pairs) - 1, max(1, round(len(pairs) * test_fraction)))
    return [pairs[i] for i in order[n_test:]], [pairs[i] for i in order[:n_test]]


def split_text(text: str, test_fraction: float) -> tuple[str, str]:
    """The last ``test_fraction`` of the text is held out (a fixed, contiguous split)."""
    cut = int(len(text) * (1 - test_fraction))
    if cut < 2 or len(text) - cut < 2:
        raise DataError(f"text of {len(text)} characters is too short to split train/held-out")
    return text[:cut], text[cut:]
