"""Write-behind of saved chunks to the record tiers (disk, redis).

Ownership rule: `submit` copies the caller's tensors before it returns, so the caller may
reuse its staging buffers at once. The copy goes into the cpu tier's slot when there is
a cpu tier (the slot is then referenced until the record is encoded, so it cannot be
evicted under the writer), else into a record-sized staging buffer that becomes the
record itself (header written in place, no second copy unless compressed). At most half
of the cpu slots are held that way, so a burst of saves cannot freeze the cpu tier's LRU;
beyond that a chunk is copied twice (slot and staging buffer).

Bytes waiting to be written are bounded by `max_pending_bytes`; beyond it, the lower-tier
write of a chunk is dropped and counted rather than blocking the engine's step loop.
Records are encoded in a worker thread (xxh3, lz4 and HMAC are CPU work), then handed
to every record tier, tiers in parallel; a tier keeps what it already holds (local tiers
were asked before the copy, Redis checks with one EXISTS pipeline inside its put).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvstore.keys import ChunkKey
from kvstore.parts import StoreParts
from kvstore.runtime import pending_future, resolved
from kvstore.spec import tensor_bytes
from tiers.base import RecordTier


@dataclass(frozen=True)
class SaveResult:
    """Per key, the tiers that hold the chunk once the save finished."""

    stored: tuple[frozenset[str], ...]
    complete: bool  # every configured tier holds every chunk


@dataclass(eq=False)
class _Item:
    key: ChunkKey
    stored: set[str]
    targets: list[RecordTier]
    slot: int | None = None
    staging: bytearray | None = None
    record: memoryview | None = None


@dataclass(eq=False)
class _Job:
    stored: list[set[str]]
    items: list[_Item]
    nbytes: int
    future: Future[SaveResult] = field(default_factory=pending_future)
    done: bool = False


class WriteBehind:
    def __init__(self, parts: StoreParts, max_pending_bytes: int) -> None:
        self._parts = parts
        self._max_pending = max_pending_bytes
        self._pending = 0
        self._held_slots = 0
        cpu = parts.cpu
        self._max_held_slots = cpu.num_slots // 2 if cpu is not None else 0
        self._lock = threading.Lock()
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._all_tiers = frozenset(([cpu.name] if cpu else []) + [t.name for t in parts.lower])

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def start(self, workers: int) -> None:
        for index in range(workers):
            self._parts.runtime.supervise(f"writer-{index}", self._work)

    def submit(
        self, keys: Sequence[ChunkKey], tensors: Sequence[torch.Tensor]
    ) -> Future[SaveResult]:
        """Copy every tensor now; write the lower tiers in the background."""
        stored: list[set[str]] = []
        items: list[_Item] = []
        for key, tensor in zip(keys, tensors, strict=True):
            item = self._prepare(key, tensor)
            stored.append(item.stored)
            if item.targets:
                items.append(item)
        self._parts.counters.add(saves=1, save_chunks=len(keys))
        job = _Job(stored, items, len(items) * self._parts.codec.spec.nbytes)
        if not items:
            return resolved(self._result(job))
        self._parts.runtime.loop.call_soon_threadsafe(self._queue.put_nowait, job)
        return job.future

    async def drain(self) -> None:
        await self._queue.join()

    def abandon_queued(self) -> None:
        """Resolve jobs that no worker will take (at shutdown, on the loop thread)."""
        while not self._queue.empty():
            self._finish(self._queue.get_nowait(), reuse_buffers=True)
            self._queue.task_done()

    def _prepare(self, key: ChunkKey, tensor: torch.Tensor) -> _Item:
        item = _Item(key, set(), [])
        if self._parts.cpu is not None and self._parts.cpu.put_from(key.name, tensor):
            item.stored.add(self._parts.cpu.name)
        for tier in self._parts.lower:
            if tier.has_local(key.name):
                item.stored.add(tier.name)
            else:
                item.targets.append(tier)
        if not item.targets:
            return item
        if not self._reserve(self._parts.codec.spec.nbytes):
            self._parts.counters.add(save_dropped_chunks=1)
            item.targets = []
            return item
        if item.stored and self._hold_slot():
            item.slot = self._parts.cpu.acquire(key.name)
            if item.slot is None:
                self._unhold_slot()
        if item.slot is None:
            item.staging = self._parts.buffers.take()
            self._parts.codec.payload_view(item.staging)[:] = tensor_bytes(tensor)
        return item

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            written = False
            try:
                await self._write(job)
                written = True
            finally:
                # an interrupted write may still be reading its buffers in an I/O thread
                self._finish(job, reuse_buffers=written)
                self._queue.task_done()

    async def _write(self, job: _Job) -> None:
        await asyncio.to_thread(self._encode, job.items)
        self._release_slots(job)
        await asyncio.gather(*(self._write_tier(tier, job.items) for tier in self._parts.lower))

    def _encode(self, items: list[_Item]) -> None:
        for item in items:
            if item.staging is not None:
                item.record = self._parts.codec.seal(item.key.block_hash, item.staging)
            else:
                item.staging = self._parts.buffers.take()
                item.record = self._parts.codec.encode(
                    item.key.block_hash, self._parts.cpu.buffer(item.slot), item.staging
                )

    async def _write_tier(self, tier: RecordTier, items: list[_Item]) -> None:
        todo = [item for item in items if tier in item.targets and item.record is not None]
        if not todo:
            return
        stored = await tier.put([(item.key.name, item.record) for item in todo])
        for item, ok in zip(todo, stored, strict=True):
            if ok:
                item.stored.add(tier.name)

    def _release_slots(self, job: _Job) -> None:
        for item in job.items:
            if item.slot is not None:
                self._parts.cpu.release(item.slot)
                item.slot = None
                self._unhold_slot()

    def _hold_slot(self) -> bool:
        with self._lock:
            if self._parts.cpu is None or self._held_slots >= self._max_held_slots:
                return False
            self._held_slots += 1
            return True

    def _unhold_slot(self) -> None:
        with self._lock:
            self._held_slots -= 1

    def _finish(self, job: _Job, reuse_buffers: bool) -> None:
        if job.done:
            return
        job.done = True
        self._release_slots(job)
        for item in job.items:
            if reuse_buffers:
                self._parts.buffers.give(item.staging)
            item.staging = item.record = None
        with self._lock:
            self._pending -= job.nbytes
        job.future.set_result(self._result(job))

    def _result(self, job: _Job) -> SaveResult:
        """The job's outcome; counts chunks that missed a tier (dropped ones included)."""
        stored = tuple(frozenset(s) for s in job.stored)
        failed = sum(not self._all_tiers <= s for s in stored)
        self._parts.counters.add(save_failed_chunks=failed)
        return SaveResult(stored, not failed)

    def _reserve(self, nbytes: int) -> bool:
        with self._lock:
            if self._pending + nbytes > self._max_pending:
                return False
            self._pending += nbytes
            return True
