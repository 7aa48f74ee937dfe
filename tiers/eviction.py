"""Eviction policies of the cpu and disk tiers: which resident key goes first when room is
needed (`--kv-offload-eviction`, vLLM's names).

A policy holds key -> value (a slot number, a file size) for the keys a tier holds and
orders them; the tier asks it for `candidates` (the keys in the order they would be
evicted, among those `evictable` allows: a pinned key or a held slot never is), then
`evict`s the ones it takes. Choosing first and evicting after lets a tier that needs
several victims (the disk tier, for a record of some size) give up without having
changed anything. Policies are not thread-safe: the tier calls them under its lock.

- lru: least recently used first. A stream of one-off records (a crawl, a batch job)
  pushes everything else out, hot system prompts included.
- arc: Adaptive Replacement Cache (Megiddo and Modha, 2003). Keys seen once live in a
  recency list (T1), keys hit again in a frequency list (T2); evicted keys are
  remembered, without their values, in ghost lists (B1 from T1, B2 from T2). A key
  stored again while it is a ghost shows which list was too short: a B1 ghost moves the
  target size of T1 (`target_recent`) up, a B2 ghost moves it down. Eviction takes from
  T1 while it is at or above its target, else from T2, so a scan of one-off keys only
  cycles through T1 and leaves the frequent keys alone.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from tiers.errors import TierConfigError

V = TypeVar("V")

EVICTION_POLICIES = ("lru", "arc")
Evictable = Callable[[str, V], bool]


class EvictionPolicy(ABC, Generic[V]):
    """The resident keys of a tier, with their values, in an eviction order."""

    @abstractmethod
    def __contains__(self, key: str) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[str]:
        """A snapshot of the resident keys (the caller may remove keys while iterating)."""

    @abstractmethod
    def get(self, key: str, touch: bool = True) -> V | None:
        """The value of a resident key, or None; `touch` counts it as a hit."""

    @abstractmethod
    def add(self, key: str, value: V) -> None:
        """Make `key` resident (a key that is resident already is replaced): a new record
        was written or read into the tier."""

    @abstractmethod
    def pop(self, key: str) -> V | None:
        """Forget `key` (deleted, vanished): not an eviction, so no trace of it is kept."""

    @abstractmethod
    def candidates(self, evictable: Evictable[V]) -> Iterator[str]:
        """The resident keys that `evictable` allows, in the order `evict`ing them one after
        the other would take them. Do not change the policy while iterating."""

    @abstractmethod
    def evict(self, key: str) -> V:
        """Remove a resident key chosen from `candidates`; its value."""


class LruPolicy(EvictionPolicy[V]):
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
        self._entries[key] = value
        self._entries.move_to_end(key)

    def pop(self, key: str) -> V | None:
        return self._entries.pop(key, None)

    def candidates(self, evictable: Evictable[V]) -> Iterator[str]:
        return (key for key, value in self._entries.items() if evictable(key, value))

    def evict(self, key: str) -> V:
        return self._entries.pop(key)


class ArcPolicy(EvictionPolicy[V]):
    """ARC over keys whose records are about the same size (one record per key).

    The cache size ARC needs (`c`, in keys) is the most keys the tier has held at once: a
    tier's budget is in bytes or slots, and once it has filled, that count is its size
    in records. Each ghost list keeps at most c keys (as vLLM's ARCOffloadingManager, looser
    than the paper's |T1| + |B1| <= c): a full recency list then still leaves ghosts, so
    a working set somewhat larger than the tier shows up as ghost hits and moves the target.
    """

    def __init__(self) -> None:
        self._recent: OrderedDict[str, V] = OrderedDict()  # T1, least recently used first
        self._frequent: OrderedDict[str, V] = OrderedDict()  # T2
        self._recent_ghosts: OrderedDict[str, None] = OrderedDict()  # B1
        self._frequent_ghosts: OrderedDict[str, None] = OrderedDict()  # B2
        self.target_recent = 0.0  # p: the size T1 is steered to, in keys
        self._size = 0  # c: the most keys held at once

    def __contains__(self, key: str) -> bool:
        return key in self._recent or key in self._frequent

    def __len__(self) -> int:
        return len(self._recent) + len(self._frequent)

    def __iter__(self) -> Iterator[str]:
        return iter([*self._recent, *self._frequent])

    @property
    def recent_keys(self) -> list[str]:
        """T1, least recently used first."""
        return list(self._recent)

    @property
    def frequent_keys(self) -> list[str]:
        """T2, least recently used first."""
        return list(self._frequent)

    def is_ghost(self, key: str) -> bool:
        return key in self._recent_ghosts or key in self._frequent_ghosts

    def get(self, key: str, touch: bool = True) -> V | None:
        if key in self._frequent:
            if touch:
                self._frequent.move_to_end(key)
            return self._frequent[key]
        if key not in self._recent:
            return None
        if not touch:
            return self._recent[key]
        value = self._frequent[key] = self._recent.pop(key)  # a second hit: frequent now
        return value

    def add(self, key: str, value: V) -> None:
        if key in self._frequent:
            self._frequent[key] = value
            self._frequent.move_to_end(key)
            return
        if key in self._recent:
            self._recent[key] = value
            self._recent.move_to_end(key)
            return
        if key in self._recent_ghosts:  # evicted from T1 too early: T1 should be longer
            step = max(1.0, len(self._frequent_ghosts) / len(self._recent_ghosts))
            self.target_recent = min(float(self._size), self.target_recent + step)
            del self._recent_ghosts[key]
            self._frequent[key] = value
        elif key in self._frequent_ghosts:  # evicted from T2 too early: T2 should be longer
            step = max(1.0, len(self._recent_ghosts) / len(self._frequent_ghosts))
            self.target_recent = max(0.0, self.target_recent - step)
            del self._frequent_ghosts[key]
            self._frequent[key] = value
        else:
            self._recent[key] = value
        self._size = max(self._size, len(self))
        self._trim_ghosts()

    def pop(self, key: str) -> V | None:
        self._recent_ghosts.pop(key, None)
        self._frequent_ghosts.pop(key, None)
        if key in self._recent:
            return self._recent.pop(key)
        return self._frequent.pop(key, None)

    def candidates(self, evictable: Evictable[V]) -> Iterator[str]:
        recent = (key for key, value in self._recent.items() if evictable(key, value))
        frequent = (key for key, value in self._frequent.items() if evictable(key, value))
        recent_left = len(self._recent)  # T1's length as the evictions so far leave it
        recent_done = frequent_done = False
        while not (recent_done and frequent_done):
            from_recent = not recent_done and (frequent_done or (recent_left and recent_left >= self.target_recent))
            key = next(recent if from_recent else frequent, None)
            if key is None:
                if from_recent:
                    recent_done = True
                else:
                    frequent_done = True
                continue
            recent_left -= from_recent
            yield key

    def evict(self, key: str) -> V:
        if key in self._recent:
            value = self._recent.pop(key)
            self._recent_ghosts[key] = None
        else:
            value = self._frequent.pop(key)
            self._frequent_ghosts[key] = None
        self._trim_ghosts()
        return value

    def _trim_ghosts(self) -> None:
        for ghosts in (self._recent_ghosts, self._frequent_ghosts):
            while len(ghosts) > self._size:
                ghosts.popitem(last=False)


def make_policy(name: str) -> EvictionPolicy:
    """The policy named `name` (one of EVICTION_POLICIES)."""
    if name == "lru":
        return LruPolicy()
    if name == "arc":
        return ArcPolicy()
    raise TierConfigError(f"eviction policy {name!r} is not one of {', '.join(EVICTION_POLICIES)}")
