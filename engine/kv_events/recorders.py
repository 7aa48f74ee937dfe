"""What becomes an event: the device pool's prefix cache and the store's block index,
each reporting changes through a listener (engine thread), turned here into vLLM's
events and handed to the publisher's queue.

Device pool (`DevicePoolEvents`, called by engine.block_pool.BlockPool): a block is
stored when its full, computed KV enters the prefix cache under its hash, and removed
when the pool evicts it (reuses its memory) or forgets its hash.

Store tiers (`TierEvents`, the listener of kvstore.index.BlockIndex): a tier holds a
block while it holds at least one record naming the block (a shared prefix sits in the
records of every sequence that saved it), so blocks are counted per tier and an event
goes out when a count leaves or reaches zero. A record whose block hashes the index
learns bit by bit (a Redis probe) counts each hash as it is learnt. A shared tier's
records count only when this instance wrote them (`stored(..., tier)`); what it learnt
of other instances' records is theirs to announce.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from engine.kv_events.schema import (
    MEDIUM_DEVICE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    external_hash,
    tier_medium,
)

Publish = Callable[[KVCacheEvent], None]


class Record(Protocol):
    """What TierEvents reads of a kvstore.index.StoredRecord."""

    name: str
    block_hashes: list[bytes | None]
    tiers: set[str]


class DevicePoolEvents:
    def __init__(self, publish: Publish, block_size: int) -> None:
        self._publish = publish
        self.block_size = block_size

    def stored(
        self, block_hashes: Sequence[bytes], parent: bytes | None, first_block: int,
        token_ids_between: Callable[[int, int], list[int]],
    ) -> None:
        """Blocks `first_block, first_block + 1, ...` of a sequence entered the prefix cache
        under `block_hashes`; `parent` is the hash of the block before them."""
        bs = self.block_size
        tokens = token_ids_between(first_block * bs, (first_block + len(block_hashes)) * bs)
        self._publish(BlockStored(
            block_hashes=[external_hash(h) for h in block_hashes],
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=tokens, block_size=bs, lora_id=None, medium=MEDIUM_DEVICE,
        ))

    def removed(self, block_hashes: Sequence[bytes]) -> None:
        if block_hashes:
            self._publish(BlockRemoved([external_hash(h) for h in block_hashes], MEDIUM_DEVICE))


class TierEvents:
    def __init__(self, publish: Publish, block_size: int) -> None:
        self._publish = publish
        self.block_size = block_size
        self._counted: dict[tuple[str, str], set[int]] = {}  # (record, tier) -> positions counted
        self._holders: dict[tuple[str, bytes], int] = {}  # (tier, block hash) -> records holding it

    def stored(self, record: Record, tier: str | None) -> None:
        """`tier` (None: no tier new to this instance's view) holds `record`, or the index
        learnt more of its block hashes: count what is new in every tier announced."""
        if tier is not None:
            self._counted.setdefault((record.name, tier), set())
        for held_in in record.tiers:
            counted = self._counted.get((record.name, held_in))
            if counted is None:
                continue
            new = [(p, h) for p, h in enumerate(record.block_hashes) if h is not None and p not in counted]
            counted.update(p for p, _ in new)
            self._count(held_in, new, record.block_hashes)

    def dropped(self, record: Record, tier: str) -> None:
        counted = self._counted.pop((record.name, tier), None)
        if not counted:
            return
        gone = []
        for position in sorted(counted):
            key = (tier, record.block_hashes[position])
            self._holders[key] -= 1
            if not self._holders[key]:
                del self._holders[key]
                gone.append(key[1])
        if gone:
            self._publish(BlockRemoved([external_hash(h) for h in gone], tier_medium(tier)))

    def _count(self, tier: str, new: Iterable[tuple[int, bytes]], hashes: Sequence[bytes | None]) -> None:
        """Count the blocks at `new` (position, hash) of a record of `tier`; announce the
        runs of those that no other record of the tier held."""
        run: list[bytes] = []
        run_start = -1
        for position, block_hash in new:
            key = (tier, block_hash)
            self._holders[key] = self._holders.get(key, 0) + 1
            if self._holders[key] > 1:
                continue
            if run and position != run_start + len(run):
                self._announce(tier, run, hashes[run_start - 1] if run_start else None)
                run = []
            if not run:
                run_start = position
            run.append(block_hash)
        if run:
            self._announce(tier, run, hashes[run_start - 1] if run_start else None)

    def _announce(self, tier: str, run: list[bytes], parent: bytes | None) -> None:
        self._publish(BlockStored(
            block_hashes=[external_hash(h) for h in run],
            parent_block_hash=None if parent is None else external_hash(parent),
            token_ids=[], block_size=self.block_size, lora_id=None, medium=tier_medium(tier),
        ))
