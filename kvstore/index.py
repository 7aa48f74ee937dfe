"""BlockIndex: which stored record holds each block, and which tiers hold each record.

Owned by the engine thread (no lock): tiers report what they store and drop through the
store's event queue, applied by `StoreManager.poll`. A record holds blocks
`[first_block, first_block + n)` of a sequence, with `first_block` a multiple of
`blocks_per_chunk`, so block `k` of a sequence sits at position `k - first_block` of any
record that holds it. Every block hash maps to the records holding it (usually one; a
shared prefix is held by the records of every sequence that saved it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(eq=False, slots=True)
class StoredRecord:
    name: str
    first_block: int
    block_hashes: list[bytes | None]  # None: a block of it this index has not learnt yet
    tiers: set[str] = field(default_factory=set)

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


@dataclass(frozen=True, slots=True)
class BlockLocation:
    record: StoredRecord
    position: int  # of the block in the record


class IndexListener(Protocol):
    """Told of every change of what the index says is stored (the KV events of
    engine/kv_events): the one place records are added and dropped."""

    def stored(self, record: StoredRecord, tier: str | None) -> None:
        """`tier` holds `record` (None: only more of its block hashes were learnt, or a
        tier holds it that this process did not write to and must not announce)."""

    def dropped(self, record: StoredRecord, tier: str) -> None:
        """`tier` no longer holds `record`."""


class BlockIndex:
    def __init__(self, tier_order: Sequence[str], blocks_per_chunk: int) -> None:
        self._rank = {name: rank for rank, name in enumerate(tier_order)}
        self.blocks_per_chunk = blocks_per_chunk
        self._records: dict[str, StoredRecord] = {}
        self._blocks: dict[bytes, list[StoredRecord]] = {}
        self.listener: IndexListener | None = None

    def __len__(self) -> int:
        return len(self._records)

    def get(self, name: str) -> StoredRecord | None:
        return self._records.get(name)

    def records(self) -> Iterator[StoredRecord]:
        return iter(self._records.values())

    def watch(self, listener: IndexListener) -> None:
        """Tell `listener` of every change from now on, and first of what is known
        already (the tiers scanned at start) as stored."""
        self.listener = listener
        for record in self._records.values():
            for tier in record.tiers:
                listener.stored(record, tier)

    def best_tier(self, record: StoredRecord) -> str:
        return min(record.tiers, key=self._rank.__getitem__)

    def add(
        self, name: str, first_block: int, block_hashes: Sequence[bytes | None], tier: str,
        announce: bool = True,
    ) -> StoredRecord | None:
        """`tier` holds the record `name`; learn whichever of its block hashes are given.
        A description that contradicts what is known of the name is ignored (None).
        `announce`: whether this process wrote or found the record itself (False for what
        it learnt of another process's writes to a shared tier)."""
        if first_block % self.blocks_per_chunk or not 1 <= len(block_hashes) <= self.blocks_per_chunk:
            return None
        record = self._records.get(name)
        if record is None:
            record = self._records[name] = StoredRecord(name, first_block, [None] * len(block_hashes))
        elif record.first_block != first_block or record.num_blocks != len(block_hashes):
            return None
        record.tiers.add(tier)
        for position, block_hash in enumerate(block_hashes):
            if block_hash is not None and record.block_hashes[position] is None:
                record.block_hashes[position] = block_hash
                self._blocks.setdefault(block_hash, []).append(record)
        if self.listener is not None:
            self.listener.stored(record, tier if announce else None)
        return record

    def learn_block(self, block_hash: bytes, block: int, name: str, num_blocks: int, tier: str) -> None:
        """`tier` holds block number `block` of a sequence in record `name` of `num_blocks`."""
        first = block - block % self.blocks_per_chunk
        if not 0 <= block - first < num_blocks:
            return
        hashes: list[bytes | None] = [None] * num_blocks
        hashes[block - first] = block_hash
        self.add(name, first, hashes, tier, announce=False)

    def discard(self, names: Iterable[str], tier: str) -> None:
        """`tier` no longer holds these records; a record no tier holds is forgotten."""
        for name in names:
            record = self._records.get(name)
            if record is None:
                continue
            if tier in record.tiers and self.listener is not None:
                self.listener.dropped(record, tier)
            record.tiers.discard(tier)
            if not record.tiers:
                self._forget(record)

    def drop_tier(self, tier: str) -> None:
        """Forget everything known about what `tier` holds."""
        self.discard([r.name for r in self._records.values() if tier in r.tiers], tier)

    def locate(self, block_hashes: Sequence[bytes], start: int, end: int) -> list[BlockLocation]:
        """Where blocks `start, start + 1, ...` of a sequence are stored, up to `end` or the
        first block no record holds. Per block: the record that continues the previous
        block's, else the one in the fastest tier (the longest on a tie)."""
        run: list[BlockLocation] = []
        previous: BlockLocation | None = None
        for block in range(start, min(end, len(block_hashes))):
            first = block - block % self.blocks_per_chunk
            holders = [
                r for r in self._blocks.get(block_hashes[block], ()) if r.first_block == first and r.tiers
            ]
            if not holders:
                break
            if previous is not None and previous.record in holders:
                record = previous.record
            else:
                record = min(holders, key=lambda r: (self._rank[self.best_tier(r)], -r.num_blocks))
            previous = BlockLocation(record, block - first)
            run.append(previous)
        return run

    def _forget(self, record: StoredRecord) -> None:
        del self._records[record.name]
        for block_hash in record.block_hashes:
            if block_hash is None:
                continue
            holders = self._blocks.get(block_hash)
            if holders is None:
                continue
            holders.remove(record)
            if not holders:
                del self._blocks[block_hash]
