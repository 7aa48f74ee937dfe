"""StoreManager: the store's answers to the scheduler, from memory only.

The manager side of vLLM's offload split (its OffloadingManager: lookup, prepare_load,
complete_load, prepare_store, complete_store); the bytes move in kvstore.transfers. The
engine thread calls every method, and none waits on I/O:

- what is stored: `poll` applies what the pools and the upkeep thread found (the only
  way the BlockIndex learns anything from another thread), then `locate`, `has_record`,
  `lookup` answer from the index; `probe` hands a question about a remote tier's block
  index to the read pool and answers with a future;
- keys and names of records (`key`, `chunk_keys`, `record_name`), pins;
- which host slots a transfer uses: `prepare_load` holds the slot of each record the
  host slots keep (the cpu tier) and reserves a slot for each record to be read;
  `complete_load` releases them and keeps what arrived (promotion); `prepare_save`
  reserves the slot a save is copied into, `complete_save` says which record tiers the
  write-behind still has to write it to. The slots' eviction policy is the host slots'
  own (tiers.cpu, tiers.eviction).

`discover` (a scan of a listable tier, at start and on the upkeep thread) is how the
index learns what other processes and earlier runs stored; it too only queues findings.
Nothing here imports torch: the manager handles names, block hashes and slot numbers,
never tensors (only `discover` reads record heads, through kvstore.record).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import RecordError, StoreClosedError, StoreConfigError
from kvstore.index import BlockIndex, BlockLocation, StoredRecord
from kvstore.loading import ReadBatch, ReadState, RecordRead
from kvstore.parts import Finding, StoreParts
from tiers.base import ALREADY_PRESENT, NO_ROOM, RecordTier, Tier, check_key
from tiers.errors import TierConfigError
from tiers.pins import PinTable

if TYPE_CHECKING:
    from kvstore.config import StoreConfig
    from kvstore.keys import ChunkKey
    from kvstore.spec import ChunkSpec
    from kvstore.transfers import Load

log = logging.getLogger(__name__)

HOST = "cpu"  # the tier name of the host slots when they keep records


@dataclass(frozen=True)
class LookupResult:
    """The leading run of keys the store holds, and the fastest tier holding each."""

    tiers: tuple[str, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.tiers)


@dataclass(eq=False)
class LoadPart:
    """Blocks [position, position + count) of record `name`, held in host slot `slot`."""

    name: str
    position: int
    count: int
    slot: int
    read: RecordRead | None  # None: the host slots keep the record (the slot is held)
    # For a record the host slots keep: the lower tier a prefetch read it from, when this
    # is the first load to take it (StoreManager._prefetched); None: the cpu tier's own.
    origin: str | None = None

    @property
    def tier(self) -> str | None:
        """Where the blocks came from (a prefetched record: the tier it was read from);
        None while they have not (or will not) arrive."""
        if self.read is None:
            return self.origin or HOST
        return self.read.tier if self.read.state is ReadState.OK else None


@dataclass(frozen=True)
class LoadPlan:
    """What `prepare_load` decided: the parts in block order, the reads among them (in
    reserved slots), and whether it stopped short at a record another read is bringing
    into the host slots (opening it again once that read settles covers more)."""

    parts: list[LoadPart]
    reads: list[RecordRead]
    blocked: bool


class StoreManager:
    def __init__(
        self,
        spec: ChunkSpec,
        parts: StoreParts,
        config: StoreConfig,
        pins: PinTable,
        tiers: Sequence[Tier],
        read_pool: Callable[[Callable[[], list]], Future[list]],
    ) -> None:
        """`tiers`: the tiers as the index names them, fastest first (the host slots
        when they keep records, then the record tiers); `read_pool` runs a probe."""
        self.spec = spec
        self.config = config
        self.pins = pins
        self.parts = parts
        self.keyer = parts.keyer
        self.host = parts.host
        self.lower = list(parts.lower)
        self.tiers = list(tiers)
        self.counters = parts.counters
        self._blocks_per_chunk = spec.blocks_per_chunk
        self._block_bytes = spec.block_bytes
        self.index = BlockIndex([t.name for t in self.tiers], self._blocks_per_chunk)
        self.closed = False
        self._read_pool = read_pool
        self._recoveries = {t.name: t.health.recoveries for t in self.lower if t.remote}
        self._prefetches: list[ReadBatch] = []  # prefetches not settled
        self._reading: dict[str, RecordRead] = {}  # started, not settled yet
        self._probes: list[_Probe] = []  # out, not applied yet
        self._probe_timeout_logged = False  # see _probe_timed_out
        # Records a prefetch read into the host slots, and the tier each came from: the
        # load that first takes one counts it for that tier (it came from there for the
        # request the prefetch was for), later loads for the cpu tier.
        self._prefetched: dict[str, str] = {}

    # keys --------------------------------------------------------------------------------

    def key(self, block_hashes: Sequence[bytes], first_block: int = 0) -> ChunkKey:
        """The key of the record of these blocks, the first of which is block `first_block`."""
        return self.keyer.key(block_hashes, first_block)

    def chunk_keys(self, block_hashes: Sequence[bytes], block_size: int) -> list[ChunkKey]:
        """Keys of every full record of a sequence, given all its full-block hashes."""
        if self.spec.chunk_tokens // block_size != self._blocks_per_chunk:
            raise StoreConfigError(f"block size {block_size} does not match the store's chunks")
        return self.keyer.chunk_keys(block_hashes)

    def record_name(self, block_hash: bytes) -> str:
        """The tier name of the record that ends with this block."""
        return self.keyer.name(block_hash)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    @property
    def has_remote_index(self) -> bool:
        """Whether a tier may hold records this process has not been told about, to be
        found with `probe`."""
        return any(t.remote for t in self.lower)

    # what is stored ----------------------------------------------------------------------

    def poll(self) -> None:
        """Apply what the pools and the upkeep thread found (writes, scans, probes), what
        the tiers dropped, and settle the prefetches that are done. A remote tier that was
        unreachable since the last poll may have lost anything meanwhile (a Redis restarted
        empty, a failover): what the index knew of it is dropped, so that its records are
        saved again (its put skips those it still holds) and probed for again. The
        recoveries are read before the findings are applied and acted on after: a finding
        of before the outage (a write to the Redis that then restarted) is no belief to keep."""
        recovered = [
            (t.name, t.health.recoveries) for t in self.lower
            if t.name in self._recoveries and t.health.recoveries != self._recoveries[t.name]
        ]
        self._apply_findings()
        for tier in self.tiers:
            removed = tier.take_removed()
            if removed:
                self.index.discard(removed, tier.name)
                if tier is self.host:
                    for name in removed:
                        self._prefetched.pop(name, None)
        for name, recoveries in recovered:
            self._recoveries[name] = recoveries
            self.index.drop_tier(name)
        done = [batch for batch in self._prefetches if batch.done()]
        if done:
            self._prefetches = [batch for batch in self._prefetches if batch not in done]
            for batch in done:
                self.counters.add(prefetch_records=sum(r.state is ReadState.OK for r in batch.reads))
                self.settle_reads(batch.reads)
                self._prefetched.update((r.name, r.tier) for r in batch.reads if r.state is ReadState.OK)

    def locate(self, block_hashes: Sequence[bytes], start: int, end: int) -> list[BlockLocation]:
        """The leading run of blocks `start..end-1` of a sequence that the store holds."""
        self.check_open()
        self.poll()
        run = self.index.locate(block_hashes, start, end)
        self.counters.add(lookups=1, lookup_blocks=max(0, end - start), lookup_hit_blocks=len(run))
        return run

    def has_record(self, name: str) -> bool:
        return self.index.get(name) is not None

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """How many leading records of `keys` the store holds, and where."""
        self.check_open()
        self.poll()
        found: list[str] = []
        for key in keys:
            record = self.index.get(key.name)
            if record is None:
                break
            found.append(self.index.best_tier(record))
        return LookupResult(tuple(found))

    def probe(self, block_hashes: Sequence[bytes], start: int, end: int) -> Future[int] | None:
        """Ask the remote tiers' block indexes about blocks `start..end-1` of a sequence
        (on the read pool); what they know is in the index once the future is done (it
        gives how many blocks were found). None when no remote tier can be asked now."""
        self.check_open()
        tiers = [t for t in self.lower if t.remote and t.health.available()]
        if not tiers or start >= end:
            return None
        self.counters.add(probes=1)
        answer = _ProbeAnswer(time.monotonic() + self.config.kv_lookup_timeout)
        probe = _Probe(list(block_hashes[start:end]), start, tiers, answer)
        answer.on_timeout = lambda: self._probe_timed_out(probe.asking)
        probe.task = self._read_pool(lambda: self._ask_index(probe))
        probe.task.add_done_callback(lambda task: probe.answer.answer(len(task.result())))
        self._probes.append(probe)
        return probe.answer

    # pins --------------------------------------------------------------------------------

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float | None = None) -> None:
        """Never evict these records from the cpu and disk tiers (of this process) until
        `ttl_s` passes or they are unpinned. Keys may be pinned before they are saved."""
        self.pins.pin((k.name for k in keys), ttl_s)

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        return self.pins.unpin(k.name for k in keys)

    # which host slots a transfer uses ----------------------------------------------------

    @property
    def keeps_loaded_records(self) -> bool:
        """Whether a record read for a load stays in the host slots afterwards (promotion,
        from its slot); if not, a load may have it read straight to where its blocks go
        (`Load.offer`)."""
        return self.host.retain and self.config.kv_promote

    def prepare_load(self, run: Sequence[BlockLocation]) -> LoadPlan:
        """The parts of a load of `run` (from `locate`): a record the host slots keep is
        held as it is, the others get a reserved slot to be read into. The plan covers
        the leading part of `run` that got a slot."""
        self.check_open()
        parts: list[LoadPart] = []
        reads: list[RecordRead] = []
        blocked = False
        for location in run:
            record = location.record
            if parts and parts[-1].name == record.name and location.position == parts[-1].position + parts[-1].count:
                parts[-1].count += 1
                continue
            part = self._open_part(record, location.position)
            if part is None:
                blocked = self._being_read(record.name)
                break
            parts.append(part)
            if part.read is not None:
                reads.append(part.read)
        self.counters.add(loads=1, load_records=len(reads))
        return LoadPlan(parts, reads, blocked)

    def complete_load(self, load: Load, copy_seconds: float | None = None) -> None:
        """A load is done and given back: records read from a lower tier are kept in the
        host slots (promotion, no copy), the slots are released. `copy_seconds`: how
        long copying its cpu-tier blocks out took (get latency)."""
        self.counters.add(load_hit_records=sum(p.read is not None and p.tier is not None for p in load.parts))
        if copy_seconds is not None and self.host.retain and any(p.read is None for p in load.parts):
            self.host.counters.observe_get(copy_seconds)
        for part in load.parts:
            if part.read is None:  # a prefetched record's hit was counted by the tier it came from
                self.host.counters.add(hits=int(part.origin is None), bytes_read=part.count * self._block_bytes)
                self.host.release(part.slot)
        self.settle_reads([p.read for p in load.parts if p.read is not None])

    def prepare_prefetch(self, records: Sequence[StoredRecord]) -> list[RecordRead]:
        """Reads bringing these records into the host slots (none: nothing to read, or
        the host slots keep nothing); `track_prefetch` their batch once started."""
        self.check_open()
        if not self.keeps_loaded_records:
            return []
        reads = []
        for record in records:
            if HOST in record.tiers:
                continue
            read = self._start_read(record)
            if read is None:
                break
            reads.append(read)
        return reads

    def track_prefetch(self, batch: ReadBatch) -> None:
        """A started prefetch batch, settled by `poll` once done."""
        self._prefetches.append(batch)

    def prepare_save(self, key: ChunkKey) -> int | None:
        """A host slot to copy the record of `key` into, or None when the record is there
        already or no slot is free (counted)."""
        self.check_open()
        slot = self.host.reserve(key.name)
        if slot == NO_ROOM:
            self.counters.add(save_skipped_records=1)
        return None if slot in (ALREADY_PRESENT, NO_ROOM) else slot

    def complete_save(self, key: ChunkKey) -> tuple[list[RecordTier], set[str]]:
        """The record of `key` was committed to its host slot: the index learns it (when
        the host slots keep it). The record tiers still to write it to, and the tiers
        holding it already."""
        stored: set[str] = set()
        if self.host.retain:
            self.index.add(key.name, key.first_block, key.block_hashes, self.host.name)
            stored.add(self.host.name)
        record = self.index.get(key.name)
        held = record.tiers if record is not None else set()
        targets = [t for t in self.lower if t.name not in held]
        stored |= {t.name for t in self.lower if t.name in held}
        self.counters.add(saves=1)
        return targets, stored

    def settle_reads(self, reads: Sequence[RecordRead]) -> None:
        """Done reads: keep the records that arrived in the host slots when they keep
        records (else free their slot), give back the slots of those that did not.
        TIMED_OUT slots are the reading task's to free."""
        keep = self.keeps_loaded_records
        for read in reads:
            self._reading.pop(read.name, None)
            if read.state is ReadState.TIMED_OUT:
                continue
            if read.state is ReadState.OK and keep and not read.placed:
                self.host.commit(read.slot)
                self.host.release(read.slot)
                self.index.add(read.name, read.first_block, self._known_hashes(read), self.host.name)
                self.counters.add(promotions=1)
            else:
                self.host.abort(read.slot)

    # learning what the record tiers hold -------------------------------------------------

    def refresh(self, tiers: Sequence[RecordTier]) -> float:
        """The upkeep step that rescans listable tiers; the seconds until the next."""
        for tier in tiers:
            self.discover(tier)
        return self.config.kv_refresh_interval

    def discover(self, tier: RecordTier) -> bool:
        """Scan a listable tier (blocking): records of this store whose head verifies are
        for the index (at the next `poll`), the others are counted on the tier and
        deleted, vanished ones are to be forgotten. False if the tier cannot be listed."""
        from kvstore.record import parse_head  # the record format imports torch (ChunkSpec)

        scan = tier.scan()
        if scan is None:
            return False
        found: list[tuple[str, int, tuple[bytes, ...]]] = []
        bad: list[str] = []
        for name, head in scan.found:
            if not name.startswith(self.keyer.namespace):
                continue  # another model, chunk size or format version: not ours to judge
            try:
                header = parse_head(head)
                self.parts.codec.check_identity(header, self.parts.block_hash_of(name))
            except (RecordError, ValueError) as exc:
                counter = exc.counter if isinstance(exc, RecordError) else "rejected_records"
                tier.counters.add(**{counter: 1})
                log.warning("kvstore: bad record %s in %s tier (%s); deleting it", name, tier.name, exc)
                bad.append(name)
                continue
            found.append((name, header.first_block, header.block_hashes))
        if bad:
            tier.delete(bad)
        for name, first_block, hashes in found:
            self.parts.findings.put(Finding(name, tier.name, first_block, hashes))
        for name in scan.gone:
            self.parts.findings.put(Finding(name, tier.name))
        return True

    def check_open(self) -> None:
        if self.closed:
            raise StoreClosedError("the KV store is closed")

    # internals ---------------------------------------------------------------------------

    def _apply_findings(self) -> None:
        """What the pools and the upkeep thread found (records read or missed, written,
        scanned or gone) and what the answered probes found, into the index."""
        while True:
            try:
                finding = self.parts.findings.get_nowait()
            except queue.Empty:
                break
            if finding.block_hashes is None:
                self.index.discard([finding.name], finding.tier)
            else:
                self.index.add(finding.name, finding.first_block, finding.block_hashes, finding.tier,
                               announce=finding.announce)
        if self._probes:
            self._probes = [p for p in self._probes if not self._settle_probe(p)]

    def _open_part(self, record: StoredRecord, position: int) -> LoadPart | None:
        """Hold `record`'s host slot, or reserve a new one to read it into; None if neither."""
        if HOST in record.tiers:
            slot = self.host.acquire(record.name)
            if slot is not None:
                return LoadPart(record.name, position, 1, slot, None, self._prefetched.pop(record.name, None))
            self.index.discard([record.name], HOST)
        read = self._start_read(record)
        if read is None:
            return None
        return LoadPart(record.name, position, 1, read.slot, read)

    def _start_read(self, record: StoredRecord) -> RecordRead | None:
        candidates = tuple(t.name for t in self.lower if t.name in record.tiers)
        if not candidates:
            return None
        slot = self.host.reserve(record.name)
        if slot in (ALREADY_PRESENT, NO_ROOM):
            return None
        read = RecordRead(record.name, record.first_block, record.num_blocks, tuple(record.block_hashes), slot, candidates)
        self._reading[record.name] = read
        return read

    def _being_read(self, name: str) -> bool:
        """Whether a read of `name` is under way or arrived and not settled yet (one that
        failed or timed out is not waited for)."""
        read = self._reading.get(name)
        return read is not None and read.state in (ReadState.PENDING, ReadState.OK)

    def _known_hashes(self, read: RecordRead) -> Sequence[bytes | None]:
        record = self.index.get(read.name)
        return record.block_hashes if record is not None else read.known_hashes

    def _ask_index(self, probe: _Probe) -> list[tuple[bytes, int, str, int, str]]:
        """The probe's task on the read pool: what each remote tier's block index says
        of its blocks, as (block hash, block, record name, blocks, tier)."""
        found: list[tuple[bytes, int, str, int, str]] = []
        try:
            for tier in probe.tiers:
                probe.asking = tier
                entries = tier.get_index([self.keyer.name(h) for h in probe.hashes])
                for offset, entry in enumerate(entries):
                    parsed = self._parse_index_entry(entry)
                    if parsed is not None:
                        found.append((probe.hashes[offset], probe.start + offset, parsed[1], parsed[0], tier.name))
        except Exception:
            self.counters.add(internal_errors=1)
            log.exception("kvstore probe failed")
        return found

    def _settle_probe(self, probe: _Probe) -> bool:
        """Learn what a probe found once its task is done, even after its answer timed
        out. Whether the probe is settled."""
        if probe.task is None or not probe.task.done():
            return False
        found = probe.task.result()
        for block_hash, block, name, num_blocks, tier_name in found:
            self.index.learn_block(block_hash, block, name, num_blocks, tier_name)
        self.counters.add(probe_hit_blocks=len(found))
        return True

    def _probe_timed_out(self, tier: RecordTier) -> None:
        """A probe that ran past the lookup timeout answers "not found": a block another
        instance saved is recomputed, a miss no other counter shows, so it is counted
        (`probe_timeouts` of the tier asked, kvtier:store_probe_timeouts) and logged once
        per store, with the option to raise: a loaded host times out every probe, and a
        line per request would flood the log."""
        tier.counters.add(probe_timeouts=1)
        if self._probe_timeout_logged:
            return
        self._probe_timeout_logged = True
        log.warning(
            "kvstore: a probe of the %s tier's block index took longer than the lookup timeout "
            "(%.3f s, --kv-lookup-timeout): the blocks it asked about count as absent and are "
            "recomputed. Counted in kvtier:store_probe_timeouts; on a loaded host raise "
            "--kv-lookup-timeout. Logged once.", tier.name, self.config.kv_lookup_timeout,
        )

    def _parse_index_entry(self, entry: bytes | None) -> tuple[int, str] | None:
        """(blocks, record name) of a block index entry, None unless it is well formed."""
        if entry is None:
            return None
        try:
            count, name = entry.decode("ascii").split(" ", 1)
            num_blocks = int(count)
            check_key(name)
        except (UnicodeDecodeError, ValueError, TierConfigError):
            return None
        if not name.startswith(self.keyer.namespace) or not 1 <= num_blocks <= self._blocks_per_chunk:
            return None
        try:
            self.parts.block_hash_of(name)
        except ValueError:
            return None
        return num_blocks, name


class _ProbeAnswer(Future[int]):
    """How many blocks a probe found; 0 once the lookup timeout passes first: whoever
    looks (`done`, `result`) after the deadline settles it so, without a thread of its
    own that would wait for the deadline."""

    def __init__(self, deadline: float) -> None:
        super().__init__()
        self.deadline = deadline
        self.on_timeout: Callable[[], None] = lambda: None  # counts and logs it
        self._lock = threading.Lock()

    def answer(self, blocks: int) -> None:
        """The first answer stands (the task's, or the timeout's)."""
        with self._lock:
            if not super().done():
                self.set_result(blocks)

    def expire(self) -> None:
        with self._lock:
            if super().done():
                return
            self.set_result(0)
        self.on_timeout()

    def done(self) -> bool:
        if not super().done() and time.monotonic() >= self.deadline:
            self.expire()
        return super().done()

    def result(self, timeout: float | None = None) -> int:
        left = max(0.0, self.deadline - time.monotonic())
        if timeout is not None and timeout < left:
            return super().result(timeout)
        with contextlib.suppress(TimeoutError):
            return super().result(left)
        self.expire()
        return super().result()


@dataclass(eq=False)
class _Probe:
    """A probe of the remote tiers' block indexes: blocks from `start` on, asked on the
    read pool."""

    hashes: list[bytes]
    start: int
    tiers: list[RecordTier]
    answer: _ProbeAnswer
    asking: RecordTier = field(init=False)  # the tier being asked
    task: Future[list[tuple[bytes, int, str, int, str]]] | None = None

    def __post_init__(self) -> None:
        self.asking = self.tiers[0]
