"""Pinned keys with an optional time to live, shared by the tiers of one store.

A pinned key is never chosen as an eviction victim. Pins are recorded by key, so a key
may be pinned before it is stored (the operator pins a system prompt, then it is
computed). Expired pins are dropped lazily when they are looked at.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable


class PinTable:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._until: dict[str, float] = {}

    def pin(self, keys: Iterable[str], ttl_s: float | None = None) -> None:
        """Pin `keys` for `ttl_s` seconds (None: until unpinned). Re-pinning extends."""
        until = math.inf if ttl_s is None else self._clock() + ttl_s
        with self._lock:
            for key in keys:
                self._until[key] = max(until, self._until.get(key, 0.0))

    def unpin(self, keys: Iterable[str]) -> int:
        with self._lock:
            return sum(self._until.pop(key, None) is not None for key in keys)

    def is_pinned(self, key: str) -> bool:
        with self._lock:
            until = self._until.get(key)
            if until is None:
                return False
            if until <= self._clock():
                del self._until[key]
                return False
            return True

    def __len__(self) -> int:
        now = self._clock()
        with self._lock:
            return sum(until > now for until in self._until.values())
