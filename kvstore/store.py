"""TieredStore: the content-addressed KV record store, as its owner builds it.

It builds the host slots (tiers.cpu: the store's own memory, one slab of record-sized
slots, reported as the `cpu` tier when they keep records), the record tiers below them
(disk, then Redis), the pools and the upkeep thread, and the two halves the connector
talks to (docs/ARCHITECTURE.md, KV store):

- `manager` (kvstore.manager.StoreManager): what the scheduler asks, answered from the
  in-memory BlockIndex on the engine thread, and which slots a load or a save uses;
- `transfers` (kvstore.transfers.Transfers): what moves bytes, a load read into host
  slots on the read pool, a save committed from a slot to the write-behind.

Itself it owns the lifecycle: `make_resident`, `flush`, `drain`, `stats`, `health`,
`probe_remote`, `close`. Three kinds of store threads, no event loop: the read pool, the
write pool and one upkeep thread (kvstore.upkeep). What they find (records read,
written, scanned, probed) reaches the index only on the engine thread, when the manager
polls or settles a load: the index is never touched from another thread.

Failure model: a missing, corrupt, foreign or unreadable record, a slow or dead tier, is
a miss (counted per tier), never an exception. Exceptions are raised only for misuse: a
tensor that does not match the ChunkSpec (ChunkSpecError) or a closed store
(StoreClosedError).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future

from kvstore.compression import resolve_codec
from kvstore.config import STAGING_SIZE, StoreConfig, build_tiers
from kvstore.errors import StoreConfigError
from kvstore.keys import ChunkKeyer
from kvstore.loading import Loader
from kvstore.manager import StoreManager
from kvstore.parts import StoreParts
from kvstore.record import RecordCodec
from kvstore.saving import WriteBehind
from kvstore.spec import ChunkSpec
from kvstore.stats import StoreCounters, StoreSnapshot
from kvstore.transfers import Transfers
from kvstore.upkeep import Upkeep
from tiers.base import RecordTier, Tier
from tiers.cpu import CpuTier
from tiers.pins import PinTable

log = logging.getLogger(__name__)


class TieredStore:
    def __init__(
        self,
        spec: ChunkSpec,
        host: CpuTier,
        lower: Sequence[RecordTier] = (),
        config: StoreConfig | None = None,
        pins: PinTable | None = None,
    ) -> None:
        """Use `from_config` unless you build the tiers yourself (tests, tools). `host`:
        the store's host slots, each able to hold a record (`RecordCodec(spec).slot_bytes`);
        `lower`: the record tiers, in lookup order."""
        self.spec = spec
        self.config = config or StoreConfig()
        self.pins = pins or PinTable()
        self.host = host
        self.lower = list(lower)
        # The tiers as the index and the stats name them: the host slots when they keep
        # records (the cpu tier), then the record tiers.
        self.tiers: list[Tier] = ([host] if host.retain else []) + self.lower
        names = [t.name for t in self.tiers]
        if not names or len(set(names)) != len(names):
            raise StoreConfigError(f"a store needs distinct tiers, got {names}")
        for tier in self.tiers:
            tier.pins = self.pins
        keyer = ChunkKeyer(spec.fingerprint, spec.chunk_tokens, spec.blocks_per_chunk)
        self.codec = RecordCodec(spec, resolve_codec(self.config.kv_compress, spec.itemsize), self.config.secret_bytes)
        if host.slot_bytes < self.codec.slot_bytes:
            raise StoreConfigError(f"host slots of {host.slot_bytes} bytes cannot hold a record")
        self.counters = StoreCounters()
        parts = StoreParts(self.codec, keyer, host, self.lower, self.counters)
        self._loader = Loader(parts)
        self._writer = WriteBehind(parts, self.config.kv_max_pending_writes, self.config.kv_write_workers)
        self._upkeep = Upkeep()
        self.manager = StoreManager(spec, parts, self.config, self.pins, self.tiers, self._loader.pool.submit)
        self.transfers = Transfers(spec, parts, self.manager, self._loader, self._writer)
        listable = [t for t in self.lower if self.manager.discover(t)]
        self.manager.poll()
        for tier in [host, *self.lower]:  # the host slots', whether they keep records or stage them
            for name, step in tier.upkeep():
                self._upkeep.every(name, step)
        if listable:
            self._upkeep.every("index-refresh", lambda: self.manager.refresh(listable), self.config.kv_refresh_interval)

    @classmethod
    def from_config(cls, spec: ChunkSpec, config: StoreConfig, staging_size: int = STAGING_SIZE) -> TieredStore:
        """Build the store and its tiers, e.g. `from_config(spec, StoreConfig(kv_offload="cpu,disk",
        kv_offload_disk_path="/var/kv"))`; `staging_size`: bytes of host slots when there is
        no cpu tier (with one, the slots touched up front)."""
        pins = PinTable()
        host, lower = build_tiers(RecordCodec(spec), config, pins, staging_size)
        return cls(spec, host, lower, config, pins)

    # lifecycle ---------------------------------------------------------------------------

    def make_resident(self) -> None:
        """Fault in all of the host slots' slab now, so that no step pays
        for a first touch; blocks for as long as the kernel takes (longer on a VM whose
        host backs its memory lazily)."""
        self.manager.check_open()
        start = time.perf_counter()
        self.host.make_resident()
        log.info("kvstore: %.2f GiB of host memory resident in %.1f s",
                 self.host.slab.numel() / 2**30, time.perf_counter() - start)

    def flush(self, tiers: Sequence[str] | None = None) -> Future[dict[str, int]]:
        """Start dropping every unpinned record of this model, chunk size and format from
        the given tiers (default all); other models sharing a directory or Redis are left
        alone. Returns at once with the future of the count per tier: the clears run on the
        upkeep thread (a Redis SCAN of millions of keys takes tens of seconds, which must
        not stall the engine thread that calls this), and the index forgets the removed
        records at the manager's next `poll`. Cancelling the future before the clear starts skips it."""
        self.manager.check_open()
        chosen = [t for t in self.tiers if tiers is None or t.name in tiers]
        return self._upkeep.submit(lambda: {t.name: t.clear(self.manager.keyer.namespace) for t in chosen})

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every pending write is done; False on timeout."""
        self.manager.check_open()
        if not self._writer.drain(timeout_s):
            return False
        self.manager.poll()
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
        if self.manager.closed:
            return
        if not self.drain(timeout_s):
            log.warning("kvstore close: pending writes did not finish in %.1fs; dropping them", timeout_s)
        self.manager.closed = True
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
