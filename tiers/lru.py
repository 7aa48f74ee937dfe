"""Least-recently-used order of a tier's keys, with eviction that skips pinned keys."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

V = TypeVar("V")


class LruIndex(Generic[V]):
    """key -> value (a slot number, a file size) in LRU order; not thread-safe."""

    def __init__(self) -> None:
        self._entries: OrderedDict[str, V] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def get(self, key: str, touch: bool = True) -> V | None:
        value = self._entries.get(key)
        if value is not None and touch:
            self._entries.move_to_end(key)
        return value

    def add(self, key: str, value: V) -> None:
        """Insert (or replace) `key` as the most recently used entry."""
        self._entries[key] = value
        self._entries.move_to_end(key)

    def add_oldest(self, key: str, value: V) -> None:
        """Insert `key` as the least recently used entry (used when rebuilding an index)."""
        self._entries[key] = value
        self._entries.move_to_end(key, last=False)

    def pop(self, key: str) -> V | None:
        return self._entries.pop(key, None)

    def victim(self, evictable: Callable[[str, V], bool]) -> str | None:
        """The least recently used key that `evictable` allows, or None."""
        for key, value in self._entries.items():
            if evictable(key, value):
                return key
        return None
