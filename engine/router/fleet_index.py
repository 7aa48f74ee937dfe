"""FleetIndex: which instance holds which block where, from the instances' KV events.

Per instance, block (vLLM's external hash, engine/kv_events/schema.py) -> a bit per
medium it holds the block in (device, cpu, disk). Blocks in a shared store are kept per
store, with the instances that announced them: every instance that loads from that store
(the same `shared_store` in its /instance) can load them, whoever wrote them.

Event streams apply batches from their threads and the router scores from the event
loop, so every access takes the one lock; a score walks one prompt's blocks per instance.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.kv_events.schema import (
    MEDIUM_DEVICE,
    SHARED_PREFIX,
    AllBlocksCleared,
    BlockStored,
    KVCacheEvent,
)

DEVICE, CPU, DISK = 1, 2, 4
_BITS = {MEDIUM_DEVICE: DEVICE, "CPU": CPU, "DISK": DISK}


@dataclass(frozen=True, slots=True)
class Holding:
    """What an instance can use of a prompt's leading blocks: `device` blocks in its
    device cache, then `loadable` more from its tiers or the shared store, by tier."""

    device: int
    loadable: dict[str, int]

    @property
    def blocks(self) -> int:
        return self.device + sum(self.loadable.values())


class FleetIndex:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, dict[int, int]] = {}  # instance -> block -> medium bits
        self._shared: dict[str, dict[int, set[str]]] = {}  # store -> block -> announcing instances
        self._store_of: dict[str, str | None] = {}  # instance -> the shared store it loads from

    def join(self, instance: str, shared_store: str | None) -> None:
        """Start (or restart) indexing `instance`, with nothing known of it yet."""
        with self._lock:
            self._forget(instance)
            self._held[instance] = {}
            self._store_of[instance] = shared_store

    def leave(self, instance: str) -> None:
        with self._lock:
            self._forget(instance)
            self._store_of.pop(instance, None)

    def apply(self, instance: str, events: Iterable[KVCacheEvent]) -> None:
        with self._lock:
            held = self._held.get(instance)
            if held is None:
                return
            store = self._store_of.get(instance)
            for event in events:
                if isinstance(event, AllBlocksCleared):
                    self._forget(instance)
                    held = self._held[instance] = {}
                    continue
                medium = event.medium or MEDIUM_DEVICE
                stored = isinstance(event, BlockStored)
                if medium.startswith(SHARED_PREFIX):
                    if store is not None:
                        self._apply_shared(instance, store, event.block_hashes, stored)
                    continue
                bit = _BITS.get(medium)
                if bit is None:
                    continue
                if stored:
                    for block in event.block_hashes:
                        held[block] = held.get(block, 0) | bit
                else:
                    for block in event.block_hashes:
                        left = held.get(block, 0) & ~bit
                        if left:
                            held[block] = left
                        else:
                            held.pop(block, None)

    def holdings(self, instances: Iterable[str], blocks: Sequence[int]) -> dict[str, Holding]:
        """The leading blocks of a prompt each instance can use, as its engine finds them:
        the run in its device cache, then the run its store holds (each block from its
        fastest tier: cpu, disk, then the shared store)."""
        with self._lock:
            return {instance: self._holding(instance, blocks) for instance in instances}

    def _holding(self, instance: str, blocks: Sequence[int]) -> Holding:
        held = self._held.get(instance, {})
        shared = self._shared.get(self._store_of.get(instance) or "", {})
        position, count = 0, len(blocks)
        while position < count and held.get(blocks[position], 0) & DEVICE:
            position += 1
        device = position
        loadable: dict[str, int] = {}
        while position < count:
            bits = held.get(blocks[position], 0)
            tier = "cpu" if bits & CPU else "disk" if bits & DISK else "shared" if blocks[position] in shared else None
            if tier is None:
                break
            loadable[tier] = loadable.get(tier, 0) + 1
            position += 1
        return Holding(device, loadable)

    def size(self, instance: str) -> int:
        """Blocks known of `instance` outside the shared store."""
        with self._lock:
            return len(self._held.get(instance, {}))

    def _apply_shared(self, instance: str, store: str, blocks: Iterable[int], stored: bool) -> None:
        index = self._shared.setdefault(store, {})
        for block in blocks:
            holders = index.get(block)
            if stored:
                index.setdefault(block, set()).add(instance)
            elif holders is not None:
                holders.discard(instance)
                if not holders:
                    del index[block]

    def _forget(self, instance: str) -> None:
        self._held.pop(instance, None)
        store = self._store_of.get(instance)
        if store is None or store not in self._shared:
            return
        index = self._shared[store]
        for block in [b for b, holders in index.items() if instance in holders]:
            index[block].discard(instance)
            if not index[block]:
                del index[block]
