"""The pieces of a store that its manager, its loader and its write-behind share (the
host slots, the record tiers, the record format), and the findings the pools hand the
engine thread."""

from __future__ import annotations

import queue
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tiers.base import RecordTier

if TYPE_CHECKING:
    from kvstore.keys import ChunkKeyer
    from kvstore.record import RecordCodec
    from kvstore.stats import StoreCounters
    from tiers.cpu import CpuTier


@dataclass(frozen=True)
class Finding:
    """What a pool or upkeep thread learnt of a record in a tier: it holds the record
    (`block_hashes` given, as far as known) or it does not (None). Only the engine
    thread applies findings to the index (`StoreManager.poll`), in the order they came."""

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
    host: CpuTier  # the store's host slots: every load lands in one, every save starts from one
    lower: Sequence[RecordTier]  # the record tiers, in lookup order (disk, then redis)
    counters: StoreCounters  # the store's own counters (tiers count in theirs)
    findings: queue.SimpleQueue[Finding] = field(default_factory=queue.SimpleQueue)

    def block_hash_of(self, name: str) -> bytes:
        """The hash of a record's last block, from its name."""
        return bytes.fromhex(name[len(self.keyer.namespace) :])
