"""TieredStore: the content-addressed KV record store the connector talks to.

Metadata apart from data (docs/ARCHITECTURE.md, KV store). The engine thread calls every
public method. What the scheduler asks (`locate`, `has_record`, `lookup`) is answered
from the in-memory BlockIndex, after `poll` has applied what the I/O side reported; it
never waits on I/O. Data moves through host slots (tiers.cpu): `open_load` references
the slots of records in the cpu tier and has the others read into reserved slots by the
read pool (kvstore.loading); `reserve` / `commit` take a save from the caller's copy into
a slot to the cpu tier and the write-behind's pool (kvstore.saving). `probe` asks a
remote tier's block index on the read pool. Three kinds of store threads, no event loop:
the read pool, the write pool and one upkeep thread (kvstore.upkeep). What they find
(records read, written, scanned, probed) reaches the index only on the engine thread,
when it polls or settles a load: the index is never touched from another thread.

Failure model: a missing, corrupt, foreign or unreadable record, a slow or dead tier, is
a miss (counted per tier), never an exception. Exceptions are raised only for misuse: a
tensor that does not match the ChunkSpec (ChunkSpecError) or a closed store
(StoreClosedError).
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

import torch

from kvstore.compression import resolve_codec
from kvstore.config import STAGING_SIZE, StoreConfig, build_tiers
from kvstore.errors import RecordError, StoreClosedError, StoreConfigError
from kvstore.index import BlockIndex, BlockLocation, StoredRecord
from kvstore.keys import ChunkKey, ChunkKeyer
from kvstore.loading import Destination, Loader, ReadBatch, ReadState, RecordRead
from kvstore.parts import Finding, StoreParts
from kvstore.record import RecordCodec, parse_head
from kvstore.saving import SaveResult, WriteBehind, resolved
from kvstore.spec import ChunkSpec, host_copy
from kvstore.stats import StoreCounters, StoreSnapshot
from kvstore.upkeep import Upkeep
from tiers.base import RecordTier, Tier, check_key
from tiers.cpu import ALREADY_PRESENT, NO_ROOM, CpuTier
from tiers.errors import TierConfigError
from tiers.pins import PinTable

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupResult:
    """The leading run of keys the store holds, and the fastest tier holding each."""

    tiers: tuple[str, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.tiers)


@dataclass(frozen=True)
class LoadResult:
    """Per key, the tier that delivered the record, or None for a miss."""

    tiers: tuple[str | None, ...]

    @property
    def ok(self) -> tuple[bool, ...]:
        return tuple(t is not None for t in self.tiers)

    @property
    def num_leading_ok(self) -> int:
        for index, tier in enumerate(self.tiers):
            if tier is None:
                return index
        return len(self.tiers)


@dataclass(eq=False)
class LoadPart:
    """Blocks [position, position + count) of record `name`, held in `slot`."""

    name: str
    position: int
    count: int
    slot: int
    read: RecordRead | None  # None: the record is in the cpu tier (the slot is held)
    # For a record in the cpu tier: the lower tier a prefetch read it from, when this is
    # the first load to take it (see TieredStore._prefetched); None: the cpu tier's own.
    origin: str | None = None

    @property
    def tier(self) -> str | None:
        """Where the blocks came from (a prefetched record: the tier it was read from);
        None while they have not (or will not) arrive."""
        if self.read is None:
            return self.origin or CpuTier.name
        return self.read.tier if self.read.state is ReadState.OK else None


@dataclass(eq=False)
class Load:
    """Records opened for one load, in block order; done when every read is settled (at
    once when they all were in the cpu tier). `blocked`: the load stops short at a
    record that another load or a prefetch is reading into the cpu tier, so opening it
    again once that read is settled covers more."""

    parts: list[LoadPart]
    batch: ReadBatch | None  # the reads of its parts not in the cpu tier
    blocked: bool = False
    start: Callable[[], None] = lambda: None  # begins the reads (once; opened unstarted)

    @property
    def num_blocks(self) -> int:
        return sum(part.count for part in self.parts)

    @property
    def futures(self) -> list[Future[None]]:
        """The read pool's tasks of this load (to wait on; none before it starts)."""
        return [] if self.batch is None else list(self.batch.futures)

    @property
    def deadline(self) -> float:
        """When the load is settled whatever its reads do (time.monotonic)."""
        return -float("inf") if self.batch is None else self.batch.deadline

    def done(self) -> bool:
        return self.batch is None or self.batch.done()

    def wait(self, timeout_s: float | None = None) -> bool:
        """`ReadBatch.wait` of its reads (done at once without any)."""
        return self.batch is None or self.batch.wait(timeout_s)

    def arrival(self, index: int) -> Future[None] | None:
        """The task reading part `index`, done once its record arrived verified in its
        slot or missed (None for a part from the cpu tier, or before the load starts).
        A worker may copy the part out from a callback of its own on it."""
        read = self.parts[index].read
        return None if read is None or self.batch is None else self.batch.part_of(read)

    def offer(self, index: int, destination: Destination) -> None:
        """Before the load starts: part `index` may be read straight into `destination`
        (kvstore.loading) rather than into its slot."""
        read = self.parts[index].read
        if read is not None:
            read.destination = destination

    def arrived_blocks(self) -> int:
        """Blocks of the leading run of parts that arrived (once done)."""
        total = 0
        for part in self.parts:
            if part.tier is None:
                break
            total += part.count
        return total

    def tier_runs(self, num_blocks: int) -> list[tuple[str, int]]:
        """(tier, blocks) of the first `num_blocks` blocks that arrived, in block order;
        neighbouring parts from one tier make one run (once done)."""
        runs: list[tuple[str, int]] = []
        left = num_blocks
        for part in self.parts:
            if left <= 0 or part.tier is None:
                break
            count = min(part.count, left)
            if runs and runs[-1][0] == part.tier:
                runs[-1] = (part.tier, runs[-1][1] + count)
            else:
                runs.append((part.tier, count))
            left -= count
        return runs


class TieredStore:
    def __init__(
        self,
        spec: ChunkSpec,
        memory: CpuTier,
        lower: Sequence[RecordTier] = (),
        config: StoreConfig | None = None,
        pins: PinTable | None = None,
    ) -> None:
        """Use `from_config` unless you build the tiers yourself (tests, tools).
        `memory`'s slots must hold a record (`RecordCodec(spec).slot_bytes`)."""
        self.spec = spec
        self.config = config or StoreConfig()
        self.pins = pins or PinTable()
        self.memory = memory
        self.lower = list(lower)
        self.tiers: list[Tier] = ([memory] if memory.retain else []) + self.lower
        names = [t.name for t in self.tiers]
        if not names or len(set(names)) != len(names):
            raise StoreConfigError(f"a store needs distinct tiers, got {names}")
        for tier in self.tiers:
            tier.pins = self.pins
        self.keyer = ChunkKeyer(spec.fingerprint, spec.chunk_tokens, spec.blocks_per_chunk)
        self.codec = RecordCodec(spec, resolve_codec(self.config.kv_compress, spec.itemsize), self.config.secret_bytes)
        if memory.slot_bytes < self.codec.slot_bytes:
            raise StoreConfigError(f"host slots of {memory.slot_bytes} bytes cannot hold a record")
        self.index = BlockIndex(names, spec.blocks_per_chunk)
        self._recoveries = {t.name: t.health.recoveries for t in self.lower if t.remote}
        self.counters = StoreCounters()
        self._closed = False
        self._prefetches: list[ReadBatch] = []
        self._reading: dict[str, RecordRead] = {}  # started, not settled yet
        self._probes: list[_Probe] = []  # out, not applied yet
        self._probe_timeout_logged = False  # see _probe_timed_out
        # Records a prefetch read into the cpu tier, and the tier each came from: the load
        # that first takes one counts it for that tier (it came from there for the request
        # the prefetch was for), later loads for the cpu tier.
        self._prefetched: dict[str, str] = {}
        self._parts = StoreParts(self.codec, self.keyer, memory, self.lower, self.counters)
        self._writer = WriteBehind(self._parts, self.config.kv_max_pending_writes, self.config.kv_write_workers)
        self._loader = Loader(self._parts)
        self._upkeep = Upkeep()
        listable = [t for t in self.lower if self._discover(t)]
        self.poll()
        for tier in [memory, *self.lower]:  # the memory tier's, whether it retains or stages
            for name, step in tier.upkeep():
                self._upkeep.every(name, step)
        if listable:
            self._upkeep.every("index-refresh", lambda: self._refresh(listable), self.config.kv_refresh_interval)

    @classmethod
    def from_config(cls, spec: ChunkSpec, config: StoreConfig, staging_size: int = STAGING_SIZE) -> TieredStore:
        """Build the store and its tiers, e.g. `from_config(spec, StoreConfig(kv_offload="cpu,disk",
        kv_offload_disk_path="/var/kv"))`; `staging_size`: bytes of host slots when there is
        no cpu tier (with one, the slots touched up front)."""
        pins = PinTable()
        memory, lower = build_tiers(RecordCodec(spec), config, pins, staging_size)
        return cls(spec, memory, lower, config, pins)

    # keys ------------------------------------------------------------------------------

    def key(self, block_hashes: Sequence[bytes], first_block: int = 0) -> ChunkKey:
        """The key of the record of these blocks, the first of which is block `first_block`."""
        return self.keyer.key(block_hashes, first_block)

    def chunk_keys(self, block_hashes: Sequence[bytes], block_size: int) -> list[ChunkKey]:
        """Keys of every full record of a sequence, given all its full-block hashes."""
        if self.spec.chunk_tokens // block_size != self.spec.blocks_per_chunk:
            raise StoreConfigError(f"block size {block_size} does not match the store's chunks")
        return self.keyer.chunk_keys(block_hashes)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    @property
    def has_remote_index(self) -> bool:
        """Whether a tier may hold records this process has not been told about, to be
        found with `probe`."""
        return any(t.remote for t in self.lower)

    # metadata: in memory, engine thread -------------------------------------------------

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
                if tier is self.memory:
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
                self._settle_reads(batch.reads)
                self._prefetched.update((r.name, r.tier) for r in batch.reads if r.state is ReadState.OK)

    def _apply_findings(self) -> None:
        """What the pools and the upkeep thread found (records read or missed, written,
        scanned or gone) and what the answered probes found, into the index."""
        while True:
            try:
                finding = self._parts.findings.get_nowait()
            except queue.Empty:
                break
            if finding.block_hashes is None:
                self.index.discard([finding.name], finding.tier)
            else:
                self.index.add(finding.name, finding.first_block, finding.block_hashes, finding.tier,
                               announce=finding.announce)
        if self._probes:
            self._probes = [p for p in self._probes if not self._settle_probe(p)]

    def locate(self, block_hashes: Sequence[bytes], start: int, end: int) -> list[BlockLocation]:
        """The leading run of blocks `start..end-1` of a sequence that the store holds."""
        self._check_open()
        self.poll()
        run = self.index.locate(block_hashes, start, end)
        self.counters.add(lookups=1, lookup_blocks=max(0, end - start), lookup_hit_blocks=len(run))
        return run

    def has_record(self, name: str) -> bool:
        return self.index.get(name) is not None

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """How many leading records of `keys` the store holds, and where."""
        self._check_open()
        self.poll()
        found: list[str] = []
        for key in keys:
            record = self.index.get(key.name)
            if record is None:
                break
            found.append(self.index.best_tier(record))
        return LookupResult(tuple(found))

    def probe(self, block_hashes: Sequence[bytes], start: int, end: int) -> Future[int] | None:
        """Ask the remote tiers' block indexes about blocks `start..end-1` of a sequence;
        what they know is in the index once the future is done (it gives how many blocks
        were found). None when no remote tier can be asked now."""
        self._check_open()
        tiers = [t for t in self.lower if t.remote and t.health.available()]
        if not tiers or start >= end:
            return None
        self.counters.add(probes=1)
        answer = _ProbeAnswer(time.monotonic() + self.config.kv_lookup_timeout)
        probe = _Probe(list(block_hashes[start:end]), start, tiers, answer)
        answer.on_timeout = lambda: self._probe_timed_out(probe.asking)
        probe.task = self._loader.submit(lambda: self._ask_index(probe))
        probe.task.add_done_callback(lambda task: probe.answer.answer(len(task.result())))
        self._probes.append(probe)
        return probe.answer

    # data ------------------------------------------------------------------------------

    def open_load(self, run: Sequence[BlockLocation], timeout_s: float | None = None, start: bool = True) -> Load:
        """Open the records holding `run` (from `locate`): a record in the cpu tier is
        held as it is, the others are read into reserved slots. The load covers the
        leading part of `run` that got a slot. Give it back with `close_load`. With
        `start` False its reads wait for `Load.start` (it is not done before)."""
        self._check_open()
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
        if not reads:
            return Load(parts, None, blocked)
        batch = self._loader.batch(reads, timeout_s or self.config.kv_load_timeout)
        load = Load(parts, batch, blocked, lambda: self._loader.start(batch))
        if start:
            load.start()
        return load

    @property
    def keeps_loaded_records(self) -> bool:
        """Whether a record read for a load stays in the cpu tier afterwards (promotion,
        from its slot); if not, a load may have it read straight to where its blocks go
        (`Load.offer`)."""
        return self.memory.retain and self.config.kv_promote

    def view(self, part: LoadPart) -> torch.Tensor:
        """The part's blocks in its slot, `[count, *block shape]` (valid until closed)."""
        return self._payload(part.slot, part.position, part.count)

    def close_load(self, load: Load, copy_seconds: float | None = None) -> None:
        """Give back a load that is done: records read from a lower tier are
        kept in the cpu tier (promotion, no copy), the slots are released.
        `copy_seconds`: how long copying its cpu-tier blocks out took (get latency)."""
        self.counters.add(load_hit_records=sum(p.read is not None and p.tier is not None for p in load.parts))
        if copy_seconds is not None and self.memory.retain and any(p.read is None for p in load.parts):
            self.memory.counters.observe_get(copy_seconds)
        for part in load.parts:
            if part.read is None:  # a prefetched record's hit was counted by the tier it came from
                self.memory.counters.add(hits=int(part.origin is None), bytes_read=part.count * self.spec.block_bytes)
                self.memory.release(part.slot)
        self._settle_reads([p.read for p in load.parts if p.read is not None])

    def prefetch(self, records: Sequence[StoredRecord]) -> ReadBatch | None:
        """Read these records into the cpu tier in the background; the batch is done when
        they are in (None: nothing to read, or no cpu tier to read into)."""
        self._check_open()
        if not self.memory.retain or not self.config.kv_promote:
            return None
        reads = []
        for record in records:
            if CpuTier.name in record.tiers:
                continue
            read = self._start_read(record)
            if read is None:
                break
            reads.append(read)
        if not reads:
            return None
        batch = self._loader.batch(reads, self.config.kv_load_timeout)
        self._loader.start(batch)
        self._prefetches.append(batch)
        return batch

    def prefetch_run(self, run: Sequence[BlockLocation]) -> ReadBatch | None:
        """`prefetch` of the records holding a run of blocks (from `locate`)."""
        return self.prefetch(list({id(loc.record): loc.record for loc in run}.values()))

    def record_name(self, block_hash: bytes) -> str:
        """The tier name of the record that ends with this block."""
        return self.keyer.name(block_hash)

    def reserve(self, key: ChunkKey) -> int | None:
        """A host slot to copy the record of `key` into (its payload: `payload`), or None
        when the record is there already or no slot is free (counted)."""
        self._check_open()
        slot = self.memory.reserve(key.name)
        if slot == NO_ROOM:
            self.counters.add(save_skipped_records=1)
        return None if slot in (ALREADY_PRESENT, NO_ROOM) else slot

    def payload(self, slot: int, num_blocks: int) -> torch.Tensor:
        """The first `num_blocks` blocks of a slot's payload, `[num_blocks, *block shape]`."""
        return self._payload(slot, 0, num_blocks)

    def commit(self, slot: int, key: ChunkKey, copy_seconds: float | None = None) -> Future[frozenset[str]]:
        """The record of `key` is complete in `slot`: the cpu tier holds it now, the
        write-behind writes it to the record tiers that lack it; the future gives every
        tier holding it then. The caller's reference on the slot is released.
        `copy_seconds`: how long copying it into the slot took (put latency)."""
        self.memory.commit(slot)
        if copy_seconds is not None and self.memory.retain:
            self.memory.counters.observe_put(copy_seconds)
        stored: set[str] = set()
        if self.memory.retain:
            self.index.add(key.name, key.first_block, key.block_hashes, self.memory.name)
            stored.add(self.memory.name)
        record = self.index.get(key.name)
        held = record.tiers if record is not None else set()
        targets = [t for t in self.lower if t.name not in held]
        stored |= {t.name for t in self.lower if t.name in held}
        self.counters.add(saves=1)
        future = self._writer.submit(key, slot, targets, stored)
        self.memory.release(slot)
        return future

    # tensors in and out (tests, tools, benchmarks) ----------------------------------------

    def save(self, keys: Sequence[ChunkKey], tensors: Sequence[torch.Tensor]) -> Future[SaveResult]:
        """Store records copied from caller tensors (`[n, *block shape]`, n the key's
        blocks). The tensors are copied before this returns; the future completes when the
        record tiers are written."""
        self._check_open()
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} tensors")
        for key, tensor in zip(keys, tensors, strict=True):
            if self.spec.check_tensor(tensor) != key.num_blocks:
                raise ValueError(f"key {key.name} has {key.num_blocks} blocks, its tensor {tensor.shape[0]}")
        self.poll()
        futures: list[Future[frozenset[str]]] = []
        for key, tensor in zip(keys, tensors, strict=True):
            slot = self.reserve(key)
            if slot is None:
                record = self.index.get(key.name)
                futures.append(resolved(frozenset(record.tiers) if record is not None else frozenset()))
                continue
            started = time.perf_counter()
            host_copy(self.payload(slot, key.num_blocks), tensor)
            futures.append(self.commit(slot, key, time.perf_counter() - started))
        return _gather_saves(futures, self._writer.all_tiers)

    def load(
        self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> Future[LoadResult]:
        """Copy the records of `keys` into `outs` (caller tensors `[n, *block shape]`),
        reading by name from the first tier that has them. Returns once they are copied,
        within `timeout_s` plus one record's decode, with a future that is done."""
        self._check_open()
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output tensors")
        for key, out in zip(keys, outs, strict=True):
            if self.spec.check_tensor(out) < key.num_blocks:
                raise ValueError(f"the output for {key.name} holds fewer than its {key.num_blocks} blocks")
        self.poll()
        held: list[int | None] = []
        reads: list[RecordRead | None] = []
        for key in keys:
            slot = self.memory.acquire(key.name) if self.memory.retain else None
            read = None
            if slot is None:
                slot = self.memory.reserve(key.name)
                if slot >= 0:
                    read = RecordRead(key.name, key.first_block, key.num_blocks, key.block_hashes, slot, None)
                    self._reading[key.name] = read
                else:
                    slot = None
            held.append(slot)
            reads.append(read)
        started = [r for r in reads if r is not None]
        self.counters.add(loads=1, load_records=len(started))
        if started:
            batch = self._loader.batch(started, timeout_s or self.config.kv_load_timeout)
            self._loader.start(batch)
            batch.wait()
        tiers: list[str | None] = []
        for key, out, slot, read in zip(keys, outs, held, reads, strict=True):
            arrived = slot is not None and (read is None or read.state is ReadState.OK)
            if arrived:
                host_copy(out[: key.num_blocks], self.payload(slot, key.num_blocks))
                if read is None:
                    self.memory.counters.add(hits=1, bytes_read=key.num_blocks * self.spec.block_bytes)
            tiers.append((CpuTier.name if read is None else read.tier) if arrived else None)
        for slot, read in zip(held, reads, strict=True):
            if slot is not None and read is None:
                self.memory.release(slot)
        self._settle_reads(started)
        return resolved_load(LoadResult(tuple(tiers)))

    # control -----------------------------------------------------------------------------

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float | None = None) -> None:
        """Never evict these records from the cpu and disk tiers (of this process) until
        `ttl_s` passes or they are unpinned. Keys may be pinned before they are saved."""
        self.pins.pin((k.name for k in keys), ttl_s)

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        return self.pins.unpin(k.name for k in keys)

    def make_resident(self) -> None:
        """Fault in all of the host memory (the cpu tier's slab) now, so that no step pays
        for a first touch; blocks for as long as the kernel takes (longer on a VM whose
        host backs its memory lazily)."""
        self._check_open()
        start = time.perf_counter()
        self.memory.make_resident()
        log.info("kvstore: %.2f GiB of host memory resident in %.1f s",
                 self.memory.slab.numel() / 2**30, time.perf_counter() - start)

    def flush(self, tiers: Sequence[str] | None = None) -> Future[dict[str, int]]:
        """Start dropping every unpinned record of this model, chunk size and format from
        the given tiers (default all); other models sharing a directory or Redis are left
        alone. Returns at once with the future of the count per tier: the clears run on the
        upkeep thread (a Redis SCAN of millions of keys takes tens of seconds, which must
        not stall the engine thread that calls this), and the index forgets the removed
        records at the next `poll`. Cancelling the future before the clear starts skips it."""
        self._check_open()
        chosen = [t for t in self.tiers if tiers is None or t.name in tiers]
        return self._upkeep.submit(lambda: {t.name: t.clear(self.keyer.namespace) for t in chosen})

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every pending write is done; False on timeout."""
        self._check_open()
        if not self._writer.drain(timeout_s):
            return False
        self.poll()
        return True

    def stats(self) -> StoreSnapshot:
        tokens = self.spec.chunk_tokens
        return StoreSnapshot(
            chunk_tokens=tokens,
            counters=self.counters.values(),
            tiers={t.name: t.snapshot(tokens) for t in self.tiers},
            pinned_chunks=len(self.pins),
            pending_write_bytes=self._writer.pending_bytes,
            worker_restarts=self._upkeep.restarts(),
        )

    def health(self) -> dict[str, str]:
        """Each tier's health state, read now."""
        return {t.name: t.health.state.value for t in self.tiers}

    def probe_remote(self, timeout_s: float = 5.0) -> list[str]:
        """Probe every remote tier now (its health follows the answer); the names of
        those that did not answer. A dead tier keeps being probed in the background and
        comes back by itself."""
        down = []
        for tier in self.lower:
            if tier.remote:
                try:
                    answered = self._upkeep.submit(tier.probe).result(timeout_s)
                except TimeoutError:
                    answered = False
                if not answered:
                    down.append(tier.name)
        return down

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish pending writes (up to `timeout_s`), then drop what is left: a write
        still under way leaves at worst a temporary file, never a torn record."""
        if self._closed:
            return
        if not self.drain(timeout_s):
            log.warning("kvstore close: pending writes did not finish in %.1fs; dropping them", timeout_s)
        self._closed = True
        self._upkeep.close(timeout_s)
        self._loader.close()
        self._writer.close()
        for tier in self.tiers:
            try:
                tier.close()
            except Exception as exc:
                log.debug("closing the %s tier failed: %s", tier.name, exc)

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # internals ---------------------------------------------------------------------------

    def _payload(self, slot: int, position: int, count: int) -> torch.Tensor:
        start = self.codec.payload_offset + position * self.spec.block_bytes
        raw = self.memory.tensor(slot)[start : start + count * self.spec.block_bytes]
        return raw.view(self.spec.dtype).view(count, *self.spec.block_shape)

    def _open_part(self, record: StoredRecord, position: int) -> LoadPart | None:
        """Hold `record`'s cpu slot, or start reading it into a new one; None if neither."""
        if CpuTier.name in record.tiers:
            slot = self.memory.acquire(record.name)
            if slot is not None:
                return LoadPart(record.name, position, 1, slot, None, self._prefetched.pop(record.name, None))
            self.index.discard([record.name], CpuTier.name)
        read = self._start_read(record)
        if read is None:
            return None
        return LoadPart(record.name, position, 1, read.slot, read)

    def _start_read(self, record: StoredRecord) -> RecordRead | None:
        candidates = tuple(t.name for t in self.lower if t.name in record.tiers)
        if not candidates:
            return None
        slot = self.memory.reserve(record.name)
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

    def _settle_reads(self, reads: Sequence[RecordRead]) -> None:
        """Done reads: keep the records that arrived in the cpu tier (or free their slot
        without one), give back the slots of those that did not. TIMED_OUT slots are the
        loader's to free."""
        keep = self.keeps_loaded_records
        for read in reads:
            self._reading.pop(read.name, None)
            if read.state is ReadState.TIMED_OUT:
                continue
            if read.state is ReadState.OK and keep and not read.placed:
                self.memory.commit(read.slot)
                self.memory.release(read.slot)
                self.index.add(read.name, read.first_block, self._known_hashes(read), self.memory.name)
                self.counters.add(promotions=1)
            else:
                self.memory.abort(read.slot)

    def _known_hashes(self, read: RecordRead) -> Sequence[bytes | None]:
        record = self.index.get(read.name)
        return record.block_hashes if record is not None else read.known_hashes

    def _refresh(self, tiers: Sequence[RecordTier]) -> float:
        """The upkeep step that rescans listable tiers; the seconds until the next."""
        for tier in tiers:
            self._discover(tier)
        return self.config.kv_refresh_interval

    def _discover(self, tier: RecordTier) -> bool:
        """Scan a listable tier: records of this store whose head verifies are for the
        index (at the next `poll`), the others are counted on the tier and deleted,
        vanished ones are to be forgotten. False if the tier cannot be listed."""
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
                self.codec.check_identity(header, self._parts.block_hash_of(name))
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
            self._parts.findings.put(Finding(name, tier.name, first_block, hashes))
        for name in scan.gone:
            self._parts.findings.put(Finding(name, tier.name))
        return True

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
        if not name.startswith(self.keyer.namespace) or not 1 <= num_blocks <= self.spec.blocks_per_chunk:
            return None
        try:
            self._parts.block_hash_of(name)
        except ValueError:
            return None
        return num_blocks, name

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the KV store is closed")


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


def resolved_load(result: LoadResult) -> Future[LoadResult]:
    future: Future[LoadResult] = Future()
    future.set_result(result)
    return future


def _gather_saves(futures: list[Future[frozenset[str]]], all_tiers: frozenset[str]) -> Future[SaveResult]:
    result: Future[SaveResult] = Future()
    remaining = [len(futures)]

    def one_done(_: Future[frozenset[str]]) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            stored = tuple(f.result() for f in futures)
            result.set_result(SaveResult(stored, all(all_tiers <= s for s in stored)))

    if not futures:
        result.set_result(SaveResult((), True))
    for future in futures:
        future.add_done_callback(one_done)
    return result
