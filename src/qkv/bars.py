"""Progress bars for the commands' long steps (tqdm), on standard error and only when it is a
terminal: piped or redirected output stays exactly as it was."""

from __future__ import annotations

import sys


def bar(iterable=None, enabled: bool = True, **kwargs):
    """``tqdm(iterable, **kwargs)`` on stderr, disabled off a terminal (or when not
    ``enabled``), erased when done."""
    from tqdm import tqdm

    return tqdm(iterable, file=sys.stderr, disable=not (enabled and sys.stderr.isatty()),
                leave=False, **kwargs)
