"""Reads of records from the record tiers into reserved host slots, verified in place.

A `RecordRead` is one record a load or a prefetch needs: the store reserved its slot and
says which tiers should hold it (per its index; None: ask every record tier). The
loader asks the tiers in order (disk, then redis), each for what is still missing (a
remote tier even when the index does not name it, as another process may have written
the record there), and
each tier places the record straight into the slot's record region; the record is then
verified there (kvstore.record, `settle_in_slot`) and checked against what the index
knows of it (first block, length, block hashes). A missing record, a bad one (counted
on its tier and deleted from it, so that the recomputed record can be saved again) or
one that contradicts the index is a miss, and the index forgets it in that tier.

The read's future is resolved within `timeout_s` whatever happens. A read still in
flight then (a slow disk, a stalled Redis) is TIMED_OUT: the caller treats it as a miss
and the loader itself gives its slot back once no I/O thread can write into it any more.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

from kvstore.errors import KeyMismatchError, RecordError
from kvstore.index import BlockIndex
from kvstore.parts import StoreParts
from kvstore.record import RecordHeader
from kvstore.runtime import pending_future
from tiers.base import Buffer, RecordTier, split_evenly
from tiers.read_threads import in_read_thread

log = logging.getLogger(__name__)

# A batch is read from a tier in this many concurrent parts (fewer for fewer records): the
# records of a part are verified in their slots (xxh3) while the others are still in
# flight, and Redis reads them over as many connections.
READ_PARTS = 8


class ReadState(enum.Enum):
    PENDING = "pending"
    OK = "ok"
    FAILED = "failed"
    TIMED_OUT = "timed out"  # given up on; the loader frees the slot when the I/O ends


@dataclass(eq=False)
class RecordRead:
    name: str
    first_block: int
    num_blocks: int
    known_hashes: tuple[bytes | None, ...]  # what the index knows of its blocks
    slot: int
    candidates: tuple[str, ...] | None  # tiers believed to hold it; None: every record tier
    tier: str | None = None  # where it came from
    state: ReadState = ReadState.PENDING
    on_arrival: Callable[[], None] | None = None  # called on the I/O thread once verified
    # Offered by whoever will copy the blocks out (a load on a CPU cache whose slot is not
    # kept): `place(fill)` calls `fill(destinations)`, record block -> memory, while the
    # destinations are safe to write (or returns False), and True from fill means the
    # blocks are there and verified.
    place: Callable[[Callable[[Mapping[int, memoryview]], bool]], bool] | None = None


class Loader:
    def __init__(self, parts: StoreParts) -> None:
        self._parts = parts

    def read(self, reads: Sequence[RecordRead], timeout_s: float) -> Future[None]:
        """Fill the reads' slots; the future resolves when every read is OK, FAILED or
        TIMED_OUT (at most `timeout_s` from now)."""
        future, start = self.prepare(reads, timeout_s)
        start()
        return future

    def prepare(self, reads: Sequence[RecordRead], timeout_s: float) -> tuple[Future[None], Callable[[], None]]:
        """`read`, begun when the returned function is first called (the timeout counts
        from then): the caller may first offer the reads a place (`RecordRead.place`)."""
        future: Future[None] = pending_future()
        started = False

        def start() -> None:
            nonlocal started
            if not started:
                started = True
                self._parts.runtime.spawn(self._run(list(reads), timeout_s, future))

        return future, start

    async def _run(self, reads: list[RecordRead], timeout_s: float, future: Future[None]) -> None:
        try:
            asking: list[RecordTier] = []  # the tier being read, while it is
            # tracked, so that closing the store cancels it even after its wait timed out
            task = self._parts.runtime.task(self._fill(reads, asking))
            done, _ = await asyncio.wait({task}, timeout=timeout_s)
            if not done:
                log.warning("kvstore load timed out after %.3fs; missing records are misses", timeout_s)
                for read in reads:
                    if read.state is ReadState.PENDING:
                        read.state = ReadState.TIMED_OUT
                for tier in asking:  # a tier that slow is treated as failing
                    tier.counters.add(errors=1)
                    tier.health.record_failure(f"a load took over {timeout_s}s")
            elif task.exception() is not None:
                self._parts.counters.add(internal_errors=1)
                log.error("kvstore load failed; missing records are misses", exc_info=task.exception())
                for read in reads:
                    if read.state is ReadState.PENDING:
                        read.state = ReadState.FAILED
        finally:
            future.set_result(None)

    async def _fill(self, reads: list[RecordRead], asking: list[RecordTier]) -> None:
        pending = list(reads)
        for tier in self._parts.lower:
            # the tiers the index names, and any remote one for what they failed to give
            # (another process may have written it there)
            ask = [r for r in pending if r.candidates is None or tier.name in r.candidates or tier.remote]
            if not ask:
                continue
            asking.append(tier)
            try:
                parts = split_evenly(ask, READ_PARTS)
                bad_parts = await asyncio.gather(*(self._read_part(tier, list(part)) for part in parts))
            finally:
                asking.remove(tier)
            bad = [name for part in bad_parts for name in part]
            if bad:
                await tier.delete(bad)
            pending = [r for r in pending if r.tier is None]
            if not pending:
                break
        for read in reads:
            if read.state is ReadState.TIMED_OUT:
                self._parts.memory.abort(read.slot)
            else:
                read.state = ReadState.OK if read.tier is not None else ReadState.FAILED

    async def _read_part(self, tier: RecordTier, ask: list[RecordRead]) -> list[str]:
        """Read one part of a batch from `tier` and verify its records as soon as they
        are in, while the other parts are still being read; the names of bad records.
        A record whose blocks can land where they are going (`RecordRead.place`) and that
        the tier can read without waiting goes there instead of through its slot."""
        memory, codec = self._parts.memory, self._parts.codec
        bad: list[str] = []
        placeable = [r for r in ask if r.place is not None]
        if placeable:
            outcomes = await in_read_thread(lambda: [self._place(tier, r) for r in placeable])
            for read, outcome in zip(placeable, outcomes, strict=True):
                if isinstance(outcome, RecordError):
                    self._reject(tier, read, outcome, bad)
                elif outcome is not None:
                    self._parts.counters.add(placed_records=1)
                    self._accept(tier, read, outcome)
            ask = [r for r in ask if r.tier is None and r.name not in bad]
        regions = [codec.region(memory.buffer(r.slot), r.num_blocks) for r in ask]
        records = await tier.get([r.name for r in ask], regions) if ask else []
        for read, record in zip(ask, records, strict=True):
            header = self._settle(tier, read, record, bad)
            if header is not None:
                self._accept(tier, read, header)
        return bad

    def _place(self, tier: RecordTier, read: RecordRead) -> RecordHeader | RecordError | None:
        """Try reading `read`'s record straight to where its blocks go (a read thread):
        its header once verified there, the error of a bad record, None when it could not
        be placed (the slot path reads it)."""
        codec, slot = self._parts.codec, self._parts.memory.buffer(read.slot)
        placed: list[RecordHeader] = []

        def fill(destinations: Mapping[int, memoryview]) -> bool:
            pieces = codec.scatter(slot, read.num_blocks, destinations)
            length = tier.read_in_place(read.name, pieces)
            header = None if length is None else codec.verify_scattered(
                self._parts.block_hash_of(read.name), pieces, length)
            if header is None:
                return False
            _check_against_index(header, read)
            placed.append(header)
            return True

        try:
            read.place(fill)  # type: ignore[misc]
        except RecordError as exc:
            return exc
        return placed[0] if placed else None

    def _settle(self, tier: RecordTier, read: RecordRead, record: Buffer | None, bad: list[str]) -> RecordHeader | None:
        """Verify `record` in `read`'s slot: its header, or None for a miss or a bad
        record (counted, and the index told that `tier` does not hold it)."""
        if record is None:
            tier.counters.add(misses=1)
            self._forget(tier, read)
            return None
        try:
            slot = self._parts.memory.buffer(read.slot)
            header = self._parts.codec.settle_in_slot(self._parts.block_hash_of(read.name), slot, record)
            _check_against_index(header, read)
        except RecordError as exc:
            self._reject(tier, read, exc, bad)
            return None
        return header

    def _accept(self, tier: RecordTier, read: RecordRead, header: RecordHeader) -> None:
        """A verified record: counted, indexed in `tier`, and reported arrived."""
        tier.counters.add(hits=1)
        name, first, hashes, tier_name = read.name, header.first_block, header.block_hashes, tier.name
        self._parts.post(lambda index: index.add(name, first, hashes, tier_name))
        read.tier = tier.name
        if read.on_arrival is not None:
            read.on_arrival()

    def _reject(self, tier: RecordTier, read: RecordRead, exc: RecordError, bad: list[str]) -> None:
        tier.counters.add(misses=1, **{exc.counter: 1})
        log.warning(
            "kvstore: bad record %s in %s tier (%s: %s); deleting it",
            read.name, tier.name, type(exc).__name__, exc,
        )
        bad.append(read.name)
        self._forget(tier, read)

    def _forget(self, tier: RecordTier, read: RecordRead) -> None:
        name, tier_name = read.name, tier.name

        def forget(index: BlockIndex) -> None:
            index.discard([name], tier_name)

        self._parts.post(forget)


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

