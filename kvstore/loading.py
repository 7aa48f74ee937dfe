"""Reads of records from the record tiers into reserved host slots, verified in place.

A `RecordRead` is one record a load or a prefetch needs: the manager reserved its slot and
says which tiers should hold it (per its index; None: ask every record tier). A
`ReadBatch` is the reads of one load or prefetch, split into parts that the read pool
reads concurrently (small records grouped, a large one alone): each part is one
blocking task that asks the tiers in order (disk, then redis) for what is still missing
(a remote tier even when the index does not name it, as another process may have
written the record there) with one batch call that reads into the slots' record
regions, verifies each record there (kvstore.record, `settle_in_slot`) and checks it
against what the index knows of it (first block, length, block hashes). The task returns nothing to anyone: it leaves on each read where
the record came from, and queues what it learnt (tier T holds record R, or does not) as
findings that the engine thread applies to the index when it polls (kvstore.manager), in
order: a finding of before a remote tier's outage is dropped with what the index knew
of that tier. A missing record, a bad one
(counted on its tier and deleted from it, so that the recomputed record can be saved
again) or one that contradicts the index is a miss there.

Time bound: a batch is settled `timeout_s` after it starts whatever its tasks do. The
engine thread finds out when it asks (`ReadBatch.done`); a part still in flight then (a
slow disk, a stalled Redis) is TIMED_OUT, its reads are misses, the tier it was asking
is marked failing, and the task itself gives their slots back when its I/O ends (no
thread writes into a slot the store handed out again).

A read may be offered a destination (`RecordRead.destination`: a CPU cache's blocks,
when the store does not keep what it reads): when the tier can read the record without
waiting (`RecordTier.read_in_place`), its blocks go there instead of through the slot.
"""

from __future__ import annotations

import concurrent.futures
import enum
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from kvstore.errors import KeyMismatchError, RecordError
from kvstore.parts import Finding, StoreParts
from tiers.base import Buffer, RecordTier

if TYPE_CHECKING:
    from kvstore.record import RecordHeader

log = logging.getLogger(__name__)

# Threads of the read pool: a batch's parts are read this many at a time, the records of
# a part verified in their slots (xxh3) while the others are still in flight, and Redis
# reads them over as many connections. Four, but not more than the CPUs this process may
# run on (two at least): on two cores, more readers only contend with the copies into
# the KV cache and with a local redis-server's sends.
READ_THREADS = min(4, max(2, len(os.sched_getaffinity(0))))
# Records up to this size share a part (one round trip, one task); a larger one is a part
# of its own, so that its copy into the KV cache starts as soon as it is in, while the
# pool goes on reading the next (a part's future completes when all its records have).
PART_BYTES = 1 << 20


class ReadState(enum.Enum):
    PENDING = "pending"
    OK = "ok"
    FAILED = "failed"
    TIMED_OUT = "timed out"  # given up on; its task frees the slot when its I/O ends


class Destination(Protocol):
    """Memory a read may place a record's blocks in instead of its slot."""

    def claim(self) -> Mapping[int, memoryview] | None:
        """Record block -> memory to write now; None: not now (the slot path reads it)."""
        ...

    def release(self, placed: bool) -> None:
        """The claimed memory is no longer written; `placed`: the blocks are there, verified."""
        ...


@dataclass(eq=False)
class RecordRead:
    name: str
    first_block: int
    num_blocks: int
    known_hashes: tuple[bytes | None, ...]  # what the index knows of its blocks
    slot: int
    candidates: tuple[str, ...] | None  # tiers believed to hold it; None: every record tier
    tier: str | None = None  # where it came from
    header: RecordHeader | None = None  # of the record that arrived
    state: ReadState = ReadState.PENDING
    destination: Destination | None = None
    placed: bool = False  # its blocks went to `destination`, not to the slot


@dataclass(eq=False)
class ReadBatch:
    """The reads of one load or prefetch and the read pool's tasks reading them."""

    reads: list[RecordRead]
    parts: list[list[RecordRead]]
    timeout_s: float
    futures: list[Future[None]] = field(default_factory=list)  # one per part, once started
    deadline: float = float("inf")
    lock: threading.Lock = field(default_factory=threading.Lock)
    running: set[int] = field(default_factory=set)  # parts not finished
    asking: dict[int, RecordTier] = field(default_factory=dict)  # the tier a part is reading
    timed_out: bool = False

    @property
    def started(self) -> bool:
        return bool(self.futures)

    def part_of(self, read: RecordRead) -> Future[None] | None:
        """The future of the task reading `read` (None before the batch starts)."""
        for part, future in zip(self.parts, self.futures, strict=False):
            if any(r is read for r in part):
                return future
        return None

    def done(self) -> bool:
        """Whether every read is settled: arrived, missed, or given up on at the deadline
        (which this call enforces; only the engine thread calls it)."""
        if not self.started:
            return False
        with self.lock:
            if not self.running or self.timed_out:
                return True
        if time.monotonic() < self.deadline:
            return False
        self.give_up(f"a load took over {self.timeout_s}s")
        return True

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until the batch is done, its deadline passes or `timeout_s` does (None:
        no bound but the deadline); whether it is done. Before it starts, never done."""
        if self.started:
            limit = self.deadline - time.monotonic()
            if timeout_s is not None:
                limit = min(limit, timeout_s)
            concurrent.futures.wait(self.futures, max(0.0, limit))
        return self.done()

    def give_up(self, reason: str) -> None:
        """Settle the parts still in flight as TIMED_OUT (misses); the tiers they were
        asking count a failure."""
        with self.lock:
            if not self.running or self.timed_out:
                return
            self.timed_out = True
            late = [self.parts[i] for i in self.running]
            tiers = list(self.asking.values())
        log.warning("kvstore: %s; its missing records are misses", reason)
        for part in late:
            for read in part:
                read.state = ReadState.TIMED_OUT
        for tier in tiers:  # a tier that slow is treated as failing
            tier.counters.add(errors=1)
            tier.health.record_failure(reason)


class Loader:
    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts
        # Also runs the other reads a request waits for: probes of a remote tier's block
        # index (the manager submits them here).
        self.pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvstore-read")
        self._started: list[ReadBatch] = []  # possibly still in flight

    def batch(self, reads: Sequence[RecordRead], timeout_s: float) -> ReadBatch:
        """The reads as a batch, not started (`start`): its reads may first be offered a
        destination."""
        largest = max((r.num_blocks for r in reads), default=1) * self._parts.codec.spec.block_bytes
        size = max(1, min(-(-len(reads) // READ_THREADS), PART_BYTES // largest))
        parts = [list(reads[i : i + size]) for i in range(0, len(reads), size)]
        return ReadBatch(list(reads), parts, timeout_s)

    def start(self, batch: ReadBatch) -> None:
        """Hand the batch's parts to the read pool (once); its deadline counts from now."""
        if batch.started:
            return
        batch.deadline = time.monotonic() + batch.timeout_s
        batch.running = set(range(len(batch.parts)))
        batch.futures = [self.pool.submit(self._read_part, batch, i) for i in range(len(batch.parts))]
        self._started = [b for b in self._started if b.running] + [batch]

    def close(self) -> None:
        """Stop taking reads and settle those in flight as misses; their tasks finish by
        themselves (their tiers' own timeouts bound them) and give their slots back."""
        self.pool.shutdown(wait=False, cancel_futures=True)
        for batch in self._started:
            batch.give_up("the store closed during a load")

    def _read_part(self, batch: ReadBatch, index: int) -> None:
        reads = batch.parts[index]
        try:
            self._fill(batch, index, reads)
        except Exception:
            self._parts.counters.add(internal_errors=1)
            log.exception("kvstore load failed; missing records are misses")
        finally:
            with batch.lock:
                batch.running.discard(index)
                batch.asking.pop(index, None)
                timed_out = batch.timed_out
                if not timed_out:
                    for read in reads:
                        read.state = ReadState.OK if read.tier is not None else ReadState.FAILED
            if timed_out:  # nobody waits for these slots any more: free them now
                for read in reads:
                    self._parts.host.abort(read.slot)

    def _fill(self, batch: ReadBatch, index: int, reads: list[RecordRead]) -> None:
        pending = reads
        for tier in self._parts.lower:
            # the tiers the index names, and any remote one for what they failed to give
            # (another process may have written it there)
            ask = [r for r in pending if r.candidates is None or tier.name in r.candidates or tier.remote]
            if not ask:
                continue
            with batch.lock:
                if batch.timed_out:
                    return
                batch.asking[index] = tier
            bad = self._read_from(tier, ask)
            if bad:
                tier.delete(bad)
            pending = [r for r in pending if r.tier is None]
            if not pending:
                return

    def _read_from(self, tier: RecordTier, ask: list[RecordRead]) -> list[str]:
        """Read `ask` from `tier` into their slots (or their destinations) and verify them;
        the names of bad records."""
        host, codec = self._parts.host, self._parts.codec
        bad: list[str] = []
        for read in [r for r in ask if r.destination is not None]:
            outcome = self._place(tier, read)
            if isinstance(outcome, RecordError):
                self._reject(tier, read, outcome, bad)
            elif outcome is not None:
                self._parts.counters.add(placed_records=1)
                read.placed = True
                self._accept(tier, read, outcome)
        ask = [r for r in ask if r.tier is None and r.name not in bad]
        if not ask:
            return bad
        regions = [codec.region(host.buffer(r.slot), r.num_blocks) for r in ask]
        records = tier.get([r.name for r in ask], regions)
        for read, record in zip(ask, records, strict=True):
            header = self._settle(tier, read, record, bad)
            if header is not None:
                self._accept(tier, read, header)
        return bad

    def _place(self, tier: RecordTier, read: RecordRead) -> RecordHeader | RecordError | None:
        """Try reading `read`'s record straight into its destination: its header once
        verified there, the error of a bad record, None when it could not be placed."""
        blocks = read.destination.claim()  # type: ignore[union-attr]
        if blocks is None:
            return None
        placed = False
        try:
            codec = self._parts.codec
            pieces = codec.scatter(self._parts.host.buffer(read.slot), read.num_blocks, blocks)
            length = tier.read_in_place(read.name, pieces)
            header = None if length is None else codec.verify_scattered(
                self._parts.block_hash_of(read.name), pieces, length)
            if header is not None:
                _check_against_index(header, read)
                placed = True
            return header
        except RecordError as exc:
            return exc
        finally:
            read.destination.release(placed)  # type: ignore[union-attr]

    def _settle(self, tier: RecordTier, read: RecordRead, record: Buffer | None, bad: list[str]) -> RecordHeader | None:
        """Verify `record` in `read`'s slot: its header, or None for a miss or a bad
        record (counted, and noted as a miss of `tier`)."""
        if record is None:
            tier.counters.add(misses=1)
            self._parts.findings.put(Finding(read.name, tier.name))
            return None
        try:
            slot = self._parts.host.buffer(read.slot)
            header = self._parts.codec.settle_in_slot(self._parts.block_hash_of(read.name), slot, record)
            _check_against_index(header, read)
        except RecordError as exc:
            self._reject(tier, read, exc, bad)
            return None
        return header

    def _accept(self, tier: RecordTier, read: RecordRead, header: RecordHeader) -> None:
        tier.counters.add(hits=1)
        self._parts.findings.put(Finding(read.name, tier.name, header.first_block, header.block_hashes,
                                         announce=not tier.remote))
        read.header = header
        read.tier = tier.name

    def _reject(self, tier: RecordTier, read: RecordRead, exc: RecordError, bad: list[str]) -> None:
        tier.counters.add(misses=1, **{exc.counter: 1})
        log.warning(
            "kvstore: bad record %s in %s tier (%s: %s); deleting it",
            read.name, tier.name, type(exc).__name__, exc,
        )
        bad.append(read.name)
        self._parts.findings.put(Finding(read.name, tier.name))


def _check_against_index(header: RecordHeader, read: RecordRead) -> None:
    known = [(i, h) for i, h in enumerate(read.known_hashes) if h is not None]
    if (
        header.first_block != read.first_block
        or header.num_blocks != read.num_blocks
        or any(header.block_hashes[i] != h for i, h in known)
    ):
        raise KeyMismatchError(
            f"record {read.name} holds blocks {header.first_block}+{header.num_blocks}, "
            f"the index expected {read.first_block}+{read.num_blocks} with other hashes"
        )
