"""The interface every tier implements.

Keys are opaque strings of `[0-9A-Za-z._-]` (the store derives them from chunk keys).
Two families:

- `CpuTier` holds raw chunk payloads in preallocated memory slots and is used
  synchronously (copies in and out are memcpy-fast and thread-safe).
- `RecordTier` (disk, redis) stores self-describing encoded records; its data methods
  are coroutines run on the store's I/O loop. They never raise on I/O failure: a failed
  get is a None, a failed put is False, and the failure is counted and fed to `health`.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Sequence

from tiers.errors import TierConfigError
from tiers.health import HealthMonitor
from tiers.pins import PinTable
from tiers.stats import TierCounters, TierSnapshot

Buffer = bytes | bytearray | memoryview
Worker = tuple[str, Callable[[], Awaitable[None]]]

_KEY_RE = re.compile(r"^[0-9A-Za-z._-]{1,200}$")


def check_key(key: str) -> str:
    if not _KEY_RE.match(key):
        raise TierConfigError(f"tier keys are 1-200 characters of [0-9A-Za-z._-], got {key!r}")
    return key


class Tier(ABC):
    """Common surface: membership, deletion, capacity, usage, stats, health."""

    name: str = "tier"
    remote: bool = False  # membership needs I/O (has_local answers None)

    def __init__(self, pins: PinTable | None = None) -> None:
        self.pins = pins if pins is not None else PinTable()
        self.counters = TierCounters()
        self.health = HealthMonitor()

    @property
    @abstractmethod
    def capacity_bytes(self) -> int: ...

    @property
    @abstractmethod
    def usage_bytes(self) -> int: ...

    @property
    @abstractmethod
    def entries(self) -> int: ...

    @abstractmethod
    async def contains(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    async def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys` (pinned or not); returns how many were present."""

    @abstractmethod
    async def clear(self, prefix: str = "") -> int:
        """Remove every unpinned key that starts with `prefix`; returns how many."""

    def has_local(self, key: str) -> bool | None:
        """Membership from in-process state without I/O; None if only I/O can tell."""
        return None

    def workers(self) -> Sequence[Worker]:
        """Long-running coroutines (name, factory) the store runs and supervises."""
        return ()

    async def aclose(self) -> None:
        """Release connections and file handles; the tier is unusable afterwards."""
        return None

    def snapshot(self, chunk_tokens: int = 0) -> TierSnapshot:
        get_latency, put_latency = self.counters.latencies()
        return TierSnapshot(
            name=self.name,
            health=self.health.state.value,
            last_error=self.health.last_error,
            capacity_bytes=self.capacity_bytes,
            usage_bytes=self.usage_bytes,
            entries=self.entries,
            chunk_tokens=chunk_tokens,
            counters=self.counters.values(),
            get_latency=get_latency,
            put_latency=put_latency,
        )


class RecordTier(Tier):
    """A tier of encoded records (bytes), accessed with batched coroutines."""

    @abstractmethod
    async def get(
        self, keys: Sequence[str], into: Sequence[bytearray] | None = None
    ) -> list[Buffer | None]:
        """The record of each key, or None (absent, unreadable, tier unavailable).

        `into` offers one reusable buffer per key; a tier may read the record into it
        (and return a view of it) instead of allocating. A record longer than its buffer
        is cut to the buffer's size, which the decoder then rejects."""

    @abstractmethod
    async def put(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        """Store records; True where the tier holds the key afterwards. Records are
        content addressed, so a key the tier already holds is left as it is."""
