"""The interface every tier implements.

Keys are opaque strings of `[0-9A-Za-z._-]` (the store derives them from record keys).

- `Tier`: membership, deletion, capacity, usage, stats, health, and `take_removed` (the
  names the tier stopped holding since the last call: evictions, deletions, files found
  gone), which is how the store's in-memory index follows the tier without asking it.
- `RecordTier` (disk, redis) stores self-describing encoded records. Its methods are
  plain blocking calls on batches, made from the store's thread pools (a read from its
  read pool, a write from its write pool): `get` reads records into the buffers it is
  given and returns what it read. They never raise on I/O failure: a failed get is a
  None, a failed put is False, and the failure is counted and fed to `health`.
  A record tier may also list what it holds (`scan`, for a directory) and keep a block
  index next to the records (`put(..., blocks=...)`, `get_index`, for a shared tier that
  other processes write to and that cannot be listed cheaply).

The cpu tier (tiers.cpu) is the store's host memory: its slots are where every load
lands and every save starts.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tiers.errors import TierConfigError
from tiers.health import HealthMonitor
from tiers.pins import PinTable
from tiers.stats import TierCounters, TierSnapshot

T = TypeVar("T")

Buffer = bytes | bytearray | memoryview
# Background upkeep a tier needs (name, step): the store's maintenance thread calls `step`,
# which does one short piece of work and answers the seconds until its next call (None:
# never again).
Upkeep = tuple[str, Callable[[], float | None]]
# What the host slots' `reserve` answers instead of a slot (tiers.cpu): the record is
# committed or being written already; every slot is held, reserved or pinned.
ALREADY_PRESENT = -1
NO_ROOM = -2
IndexEntry = tuple[str, bytes]  # (block name, what the tier keeps for it)

_KEY_RE = re.compile(r"^[0-9A-Za-z._-]{1,200}$")


def split_evenly(items: Sequence[T], parts: int) -> list[Sequence[T]]:
    """`items` in at most `parts` contiguous groups of near-equal size (none if empty)."""
    size = -(-len(items) // max(1, parts)) or 1
    return [items[i : i + size] for i in range(0, len(items), size)]


def check_key(key: str) -> str:
    if not _KEY_RE.match(key):
        raise TierConfigError(f"tier keys are 1-200 characters of [0-9A-Za-z._-], got {key!r}")
    return key


@dataclass
class Scan:
    """What a listable tier found since its previous scan: new records with their first
    bytes (enough for the store to parse their header), and names that are gone."""

    found: list[tuple[str, bytes]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)


class Tier(ABC):
    """Common surface: membership, deletion, capacity, usage, stats, health."""

    name: str = "tier"
    remote: bool = False  # shared with other processes and not listable: keeps a block index

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
    def contains(self, keys: Sequence[str]) -> list[bool]: ...

    @abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Remove `keys` (pinned or not); returns how many were present."""

    @abstractmethod
    def clear(self, prefix: str = "") -> int:
        """Remove every unpinned key that starts with `prefix`; returns how many."""

    def take_removed(self) -> list[str]:
        """Names this tier stopped holding since the last call (thread-safe)."""
        return []

    def upkeep(self) -> Sequence[Upkeep]:
        """Background work (name, step) the store's maintenance thread runs."""
        return ()

    def probe(self) -> bool:
        """Ask the tier's server whether it answers now (its health follows the answer);
        a tier without a server answers True."""
        return True

    def close(self) -> None:
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
    """A tier of encoded records (bytes), accessed with blocking batch calls."""

    @abstractmethod
    def get(
        self, keys: Sequence[str], into: Sequence[memoryview] | None = None
    ) -> list[Buffer | None]:
        """The record of each key, or None (absent, unreadable, tier unavailable).

        With `into` (one buffer per key) the record is placed at the start of its buffer
        and the result is a view of those bytes; a record longer than its buffer is cut
        to the buffer's size, which the decoder then rejects. Once `get` returns, nothing
        writes into the buffers any more."""

    @abstractmethod
    def put(
        self, items: Sequence[tuple[str, Buffer]], blocks: Sequence[Sequence[IndexEntry]] | None = None
    ) -> list[bool]:
        """Store records; True where the tier holds the key afterwards. Records are
        content addressed, so a key the tier already holds is left as it is. `blocks`
        gives, per record, the block index entries naming it; a tier without a block
        index ignores them."""

    def read_in_place(self, key: str, buffers: Sequence[memoryview]) -> int | None:
        """Read the record of `key` into `buffers`, filled in order, if that needs no
        waiting on a device or a network (its bytes are in memory already): its length,
        or None when it cannot be read so now (not there, not in memory, too long for the
        buffers, or a tier that cannot). May run on any thread; the buffers may have been
        written even when it answers None."""
        return None

    def scan(self) -> Scan | None:
        """Records found and gone since the previous scan (the first scan lists every
        record), or None for a tier that cannot be listed."""
        return None

    def get_index(self, names: Sequence[str]) -> list[bytes | None]:
        """The block index entry of each block name, None where there is none."""
        return [None] * len(names)
