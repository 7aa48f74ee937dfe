"""Write-behind of committed records to the record tiers (disk, redis).

A record to write is a committed host slot (kvstore.transfers): the writer holds a reference
on the slot until every target tier has answered. A task of the write pool takes up to
BATCH queued records, seals them in place (header and MAC around the payload; xxh3, HMAC
and lz4 are CPU work) and hands the slots' bytes to each tier in turn, as they are: no
copy unless compressed. A tier keeps what it already holds (Redis checks with one EXISTS
pipeline inside its put). What each tier stored is queued as a finding, which the
engine thread applies to the index when it polls (the index then knows the tier holds
the record).

Bytes waiting to be written are bounded by `max_pending_bytes`, and when the slots are
the cpu tier at most half of them are held by pending writes, so a burst of saves cannot
freeze the tier's LRU. Beyond either bound the engine is never blocked: a record the cpu
tier keeps is deferred (not held, no copy) and written when a running write finishes, if
the tier still holds it then; a record it cannot keep (staging slots, or the deferred
list full) is dropped. Either loss is counted as `save_dropped_records`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field

from kvstore.keys import ChunkKey
from kvstore.parts import Finding, StoreParts
from tiers.base import Buffer, IndexEntry, RecordTier

BATCH = 16  # records one write task takes at once
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """Per key, the tiers that hold the record once the save finished."""

    stored: tuple[frozenset[str], ...]
    complete: bool  # every configured tier holds every record


def resolved(value: frozenset[str]) -> Future[frozenset[str]]:
    future: Future[frozenset[str]] = Future()
    future.set_result(value)
    return future


@dataclass(eq=False)
class _Write:
    key: ChunkKey
    slot: int | None  # None while deferred: the record is only in the cpu tier
    targets: list[RecordTier]
    stored: set[str]
    future: Future[frozenset[str]] = field(default_factory=Future)
    record: Buffer | None = None


class WriteBehind:
    def __init__(self, parts: StoreParts, max_pending_bytes: int, workers: int) -> None:
        self._parts = parts
        self._max_pending = max_pending_bytes
        self._pending = 0
        self._held_slots = 0
        host = parts.host
        self._max_held_slots = host.num_slots // 2 if host.retain else host.num_slots
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._deferred: deque[_Write] = deque()
        self._max_deferred = host.num_slots if host.retain else 0
        self._queue: deque[_Write] = deque()
        self._unfinished = 0  # queued or being written
        self._writing: set[_Write] = set()  # taken by a write task
        self._tasks = 0  # write tasks running
        self._workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="kvstore-write")
        self.all_tiers = frozenset(([host.name] if host.retain else []) + [t.name for t in parts.lower])

    @property
    def pending_bytes(self) -> int:
        return self._pending

    def submit(self, key: ChunkKey, slot: int, targets: Sequence[RecordTier], stored: set[str]) -> Future[frozenset[str]]:
        """Write the committed record in `slot` to `targets` in the background; the future
        gives every tier that holds it then (`stored` holds it already). The caller may
        release its own reference on the slot at once."""
        if not targets:
            return resolved(frozenset(stored))
        write = _Write(key, None, list(targets), set(stored))
        with self._lock:
            if self._reserve_locked(write):
                self._parts.host.hold(slot)
                write.slot = slot
                self._queue_locked([write])
            elif self._held_slots and len(self._deferred) < self._max_deferred:
                self._deferred.append(write)
            else:
                self._parts.counters.add(save_dropped_records=1)
                return resolved(frozenset(stored))
        return write.future

    def drain(self, timeout_s: float | None) -> bool:
        """Wait until every queued write is done; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._unfinished == 0, timeout_s)

    def close(self) -> None:
        """Resolve every write's future with the tiers that hold its record now (at
        shutdown) and stop the pool. A write under way finishes in its thread, bounded by
        its tier's timeouts (a disk write leaves only a temporary file if the process ends
        first, never a torn record); the writes no task took are dropped."""
        with self._lock:
            deferred, self._deferred = list(self._deferred), deque()
            queued, self._queue = list(self._queue), deque()
            writing = list(self._writing)
        for write in deferred + writing:
            _resolve(write)
        self._finish(queued)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _queue_locked(self, writes: list[_Write]) -> None:
        self._queue.extend(writes)
        self._unfinished += len(writes)
        while self._queue and self._tasks < self._workers:
            self._tasks += 1
            self._pool.submit(self._work)

    def _work(self) -> None:
        while True:
            with self._lock:
                batch = [self._queue.popleft() for _ in range(min(BATCH, len(self._queue)))]
                if not batch:
                    self._tasks -= 1
                    return
                self._writing.update(batch)
            try:
                self._write(batch)
            except Exception:
                self._parts.counters.add(internal_errors=1)
                log.exception("kvstore write-behind failed; the records stay in the cpu tier only")
            finally:
                self._finish(batch)

    def _write(self, batch: list[_Write]) -> None:
        host, codec = self._parts.host, self._parts.codec
        for write in batch:
            write.record = codec.seal(write.key, host.buffer(write.slot))
        for tier in self._parts.lower:
            self._write_tier(tier, batch)

    def _write_tier(self, tier: RecordTier, batch: list[_Write]) -> None:
        todo = [w for w in batch if tier in w.targets]
        if not todo:
            return
        blocks = [self._index_entries(w.key) for w in todo] if tier.remote else None
        stored = tier.put([(w.key.name, w.record) for w in todo], blocks)
        for write, ok in zip(todo, stored, strict=True):
            if ok:
                write.stored.add(tier.name)
                self._parts.findings.put(Finding(write.key.name, tier.name, write.key.first_block,
                                                 write.key.block_hashes))

    def _index_entries(self, key: ChunkKey) -> list[IndexEntry]:
        """Block index entries naming `key`'s record: `<blocks> <record name>` per block."""
        value = f"{key.num_blocks} {key.name}".encode()
        return [(self._parts.keyer.name(h), value) for h in key.block_hashes]

    def _finish(self, batch: list[_Write]) -> None:
        failed = 0
        for write in batch:
            self._parts.host.release(write.slot)
            write.record = None
            with self._lock:
                self._held_slots -= 1
                self._pending -= self._nbytes(write)
                self._writing.discard(write)
            failed += not self.all_tiers <= write.stored
            _resolve(write)
        self._parts.counters.add(save_failed_records=failed)
        self._admit_deferred()
        with self._idle:
            self._unfinished -= len(batch)
            self._idle.notify_all()

    def _admit_deferred(self) -> None:
        """Queue deferred records while the bounds allow, oldest first (the next the cpu
        tier would evict); one the tier no longer holds is dropped."""
        dropped = []
        with self._lock:
            admitted = []
            while self._deferred and self._reserve_locked(self._deferred[0]):
                write = self._deferred.popleft()
                write.slot = self._parts.host.acquire(write.key.name, hit=False)
                if write.slot is None:
                    self._held_slots -= 1
                    self._pending -= self._nbytes(write)
                    dropped.append(write)
                else:
                    admitted.append(write)
            if admitted:
                self._queue_locked(admitted)
        for write in dropped:
            write.stored.discard(self._parts.host.name)
            _resolve(write)
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


def _resolve(write: _Write) -> None:
    """Answer a write's future with the tiers holding its record (once: a write under way
    at shutdown was answered then)."""
    with contextlib.suppress(InvalidStateError):
        write.future.set_result(frozenset(write.stored))
