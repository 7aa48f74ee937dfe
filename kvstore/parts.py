"""The pieces of a `TieredStore` that its loader, its write-behind and its index
refresh work with."""

from __future__ import annotations

import queue
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstore.index import BlockIndex
from kvstore.keys import ChunkKeyer
from kvstore.record import RecordCodec
from kvstore.runtime import IoRuntime
from kvstore.stats import StoreCounters
from tiers.base import RecordTier
from tiers.cpu import CpuTier

IndexEvent = Callable[[BlockIndex], None]


@dataclass(frozen=True)
class StoreParts:
    codec: RecordCodec
    keyer: ChunkKeyer
    memory: CpuTier  # the host slots every load lands in and every save starts from
    lower: Sequence[RecordTier]  # the record tiers, in lookup order (disk, then redis)
    runtime: IoRuntime  # the I/O loop the coroutines run on
    counters: StoreCounters  # the store's own counters (tiers count in theirs)
    events: queue.SimpleQueue[IndexEvent] = field(default_factory=queue.SimpleQueue)

    def post(self, event: IndexEvent) -> None:
        """Hand an index update to the engine thread (applied by `TieredStore.poll`)."""
        self.events.put(event)

    def block_hash_of(self, name: str) -> bytes:
        """The hash of a record's last block, from its name."""
        return bytes.fromhex(name[len(self.keyer.namespace) :])
