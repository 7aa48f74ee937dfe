"""Write-behind of committed records to the record tiers (disk, redis).

A record to write is a committed host slot (kvstore.store): the writer holds a reference
on the slot until every target tier has answered, seals the record in place in an
executor thread (header and MAC around the payload; xxh3, HMAC and lz4 are CPU work) and
hands the slot's bytes to the tiers, tiers in parallel, as they are: no copy unless
compressed. A tier keeps what it already holds (Redis checks with one EXISTS pipeline
inside its put). Each write it reports to the index (which then knows the tier holds the
record), through the store's event queue.

Bytes waiting to be written are bounded by `max_pending_bytes`, and when the slots are
the cpu tier at most half of them are held by pending writes, so a burst of saves cannot
freeze the tier's LRU. Beyond either bound the engine is never blocked: a record the cpu
tier keeps is deferred (not held, no copy) and written when a running write finishes, if
the tier still holds it then; a record it cannot keep (staging slots, or the deferred
list full) is dropped. Either loss is counted as `save_dropped_records`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvstore.index import BlockIndex
from kvstore.keys import ChunkKey
from kvstore.parts import StoreParts
from kvstore.runtime import pending_future, resolved
from tiers.base import Buffer, IndexEntry, RecordTier

BATCH = 16  # records one writer takes at once


@dataclass(frozen=True)
class SaveResult:
    """Per key, the tiers that hold the record once the save finished."""

    stored: tuple[frozenset[str], ...]
    complete: bool  # every configured tier holds every record


@dataclass(eq=False)
class _Write:
    key: ChunkKey
    slot: int | None  # None while deferred: the record is only in the cpu tier's LRU
    targets: list[RecordTier]
    stored: set[str]
    future: Future[frozenset[str]] = field(default_factory=pending_future)
    record: Buffer | None = None


class WriteBehind:
    def __init__(self, parts: StoreParts, max_pending_bytes: int) -> None:
        self._parts = parts
        self._max_pending = max_pending_bytes
        self._pending = 0
        self._held_slots = 0
        memory = parts.memory
        self._max_held_slots = memory.num_slots // 2 if memory.retain else memory.num_slots
        self._lock = threading.Lock()
        self._deferred: deque[_Write] = deque()
        self._max_deferred = memory.num_slots if memory.retain else 0
        self._queue: asyncio.Queue[_Write] = asyncio.Queue()
        self.all_tiers = frozenset(([memory.name] if memory.retain else []) + [t.name for t in parts.lower])

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def start(self, workers: int) -> None:
        for index in range(workers):
            self._parts.runtime.supervise(f"writer-{index}", self._work)

    def submit(self, key: ChunkKey, slot: int, targets: Sequence[RecordTier], stored: set[str]) -> Future[frozenset[str]]:
        """Write the committed record in `slot` to `targets` in the background; the future
        gives every tier that holds it then (`stored` holds it already). The caller may
        release its own reference on the slot at once."""
        if not targets:
            return resolved(frozenset(stored))
        write = _Write(key, None, list(targets), set(stored))
        with self._lock:
            if self._reserve_locked(write):
                self._parts.memory.hold(slot)
                write.slot = slot
            elif self._held_slots and len(self._deferred) < self._max_deferred:
                self._deferred.append(write)
                return write.future
            else:
                self._parts.counters.add(save_dropped_records=1)
                return resolved(frozenset(stored))
        self._parts.runtime.loop.call_soon_threadsafe(self._queue.put_nowait, write)
        return write.future

    async def drain(self) -> None:
        await self._queue.join()

    def abandon_queued(self) -> None:
        """Resolve writes that no worker will take (at shutdown, on the loop thread)."""
        with self._lock:
            deferred, self._deferred = list(self._deferred), deque()
        for write in deferred:
            write.future.set_result(frozenset(write.stored))
        while not self._queue.empty():
            self._finish([self._queue.get_nowait()], release=True)
            self._queue.task_done()

    async def _work(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while len(batch) < BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            written = False
            try:
                await self._write(batch)
                written = True
            finally:
                # an interrupted write may still be reading its slot in an I/O thread
                self._finish(batch, release=written)
                for _ in batch:
                    self._queue.task_done()

    async def _write(self, batch: list[_Write]) -> None:
        await asyncio.to_thread(self._seal, batch)
        await asyncio.gather(*(self._write_tier(tier, batch) for tier in self._parts.lower))

    def _seal(self, batch: list[_Write]) -> None:
        memory, codec = self._parts.memory, self._parts.codec
        for write in batch:
            write.record = codec.seal(write.key, memory.buffer(write.slot))

    async def _write_tier(self, tier: RecordTier, batch: list[_Write]) -> None:
        todo = [w for w in batch if tier in w.targets]
        if not todo:
            return
        blocks = [self._index_entries(w.key) for w in todo] if tier.remote else None
        stored = await tier.put([(w.key.name, w.record) for w in todo], blocks)
        written = [w.key for w, ok in zip(todo, stored, strict=True) if ok]
        for write, ok in zip(todo, stored, strict=True):
            if ok:
                write.stored.add(tier.name)
        if written:
            tier_name = tier.name

            def learn(index: BlockIndex) -> None:
                for key in written:
                    index.add(key.name, key.first_block, key.block_hashes, tier_name)

            self._parts.post(learn)

    def _index_entries(self, key: ChunkKey) -> list[IndexEntry]:
        """Block index entries naming `key`'s record: `<blocks> <record name>` per block."""
        value = f"{key.num_blocks} {key.name}".encode()
        return [(self._parts.keyer.name(h), value) for h in key.block_hashes]

    def _finish(self, batch: list[_Write], release: bool) -> None:
        failed = 0
        for write in batch:
            if release:
                self._parts.memory.release(write.slot)
            write.record = None
            with self._lock:
                self._held_slots -= 1
                self._pending -= self._nbytes(write)
            failed += not self.all_tiers <= write.stored
            write.future.set_result(frozenset(write.stored))
        self._parts.counters.add(save_failed_records=failed)
        self._admit_deferred()

    def _admit_deferred(self) -> None:
        """Queue deferred records while the bounds allow, oldest first (the next the cpu
        tier would evict); one the tier no longer holds is dropped."""
        admitted, dropped = [], []
        with self._lock:
            while self._deferred and self._reserve_locked(self._deferred[0]):
                write = self._deferred.popleft()
                write.slot = self._parts.memory.acquire(write.key.name, hit=False)
                if write.slot is None:
                    self._held_slots -= 1
                    self._pending -= self._nbytes(write)
                    dropped.append(write)
                else:
                    admitted.append(write)
        for write in admitted:
            self._queue.put_nowait(write)
        for write in dropped:
            write.stored.discard(self._parts.memory.name)
            write.future.set_result(frozenset(write.stored))
        if dropped:
            self._parts.counters.add(save_dropped_records=len(dropped))

    def _nbytes(self, write: _Write) -> int:
        return write.key.num_blocks * self._parts.codec.spec.block_bytes

    def _reserve_locked(self, write: _Write) -> bool:
        nbytes = self._nbytes(write)
        if self._pending + nbytes > self._max_pending or self._held_slots >= self._max_held_slots:
            return False
        self._pending += nbytes
        self._held_slots += 1
        return True
