"""The pieces of a `TieredStore` that its loader and its write-behind work with, and
the findings they hand the engine thread."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.keys import ChunkKeyer
from kvstore.record import RecordCodec
from kvstore.stats import StoreCounters
from tiers.base import RecordTier
from tiers.cpu import CpuTier


@dataclass(frozen=True)
class Finding:
    """What a pool or upkeep thread learnt of a record in a tier: it holds the record
    (`block_hashes` given, as far as known) or it does not (None). Only the engine
    thread applies findings to the index (`TieredStore.poll`), in the order they came."""

    name: str
    tier: str
    first_block: int = 0
    block_hashes: Sequence[bytes | None] | None = None
    # False for a record read from a shared tier, which another process may have written:
    # its writer announces it (BlockIndex.add)
    announce: bool = True


@dataclass(frozen=True)
class StoreParts:
    codec: RecordCodec
    keyer: ChunkKeyer
    memory: CpuTier  # the host slots every load lands in and every save starts from
    lower: Sequence[RecordTier]  # the record tiers, in lookup order (disk, then redis)
    counters: StoreCounters  # the store's own counters (tiers count in theirs)
    findings: queue.SimpleQueue[Finding] = field(default_factory=queue.SimpleQueue)

    def block_hash_of(self, name: str) -> bytes:
        """The hash of a record's last block, from its name."""
        return bytes.fromhex(name[len(self.keyer.namespace) :])
