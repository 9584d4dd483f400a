"""The last few values by key, shared by the threads that call attention: the masks checked
for stick-breaking (``weighting``), and in the engines traces of variants
(``kernelgen.memo``), block layouts (``triton.blocks``) and tile plans (``tiles``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable


class Kept:
    """Up to ``size`` values by key; the least recently used goes first."""

    def __init__(self, size: int):
        self.size = size
        self._values: OrderedDict[Hashable, object] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable):
        """The value kept for ``key``, or None."""
        with self._lock:
            value = self._values.get(key)
            if value is not None:
                self._values.move_to_end(key)
            return value

    def get_or_make(self, key: Hashable, make: Callable[[], object]):
        """The value kept for ``key``, else ``make()`` kept (made outside the lock: two
        threads may both make it, and the first kept is the one both get)."""
        value = self.get(key)
        return value if value is not None else self.keep(key, make())

    def keep(self, key: Hashable, value):
        """Keep ``value`` for ``key`` unless another thread kept one first; the kept one."""
        with self._lock:
            value = self._values.setdefault(key, value)
            self._values.move_to_end(key)
            while len(self._values) > self.size:
                self._values.popitem(last=False)
            return value

    def values(self) -> list:
        with self._lock:
            return list(self._values.values())

    def clear(self) -> None:
        with self._lock:
            self._values.clear()

    def __len__(self) -> int:
        return len(self._values)
