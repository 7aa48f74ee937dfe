"""KVStoreConnector: the connector interface (connectors/base.py) on kvstore.TieredStore.

It composes the planner (connectors/planner.py: what to load and save, asking the store's
manager, which answers from its in-memory index) and the worker (connectors/worker.py:
the copies between host slots and the device cache, through the store's transfers);
admin calls go to the manager (pins, lookups) or to the store itself (lifecycle, stats). Call order and the life of a load or a save: docs/ARCHITECTURE.md,
"Connector".

A step whose meta was built but never started (the engine ran no forward: nothing was
scheduled) hands its copies on to the next step's meta, so a preempted request's blocks
are still copied out before any forward overwrites them and an opened load still
reaches the device or is given back.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence

import torch

from connectors.base import (
    ConnectorConfigError,
    ConnectorRequest,
    FinishedLoads,
    ScheduledBatch,
)
from connectors.config import ConnectorConfig
from connectors.planner import ChunkGeometry, Planner, StepMeta
from connectors.stats import connector_stats, tier_view
from connectors.worker import Worker
from kvstore import ChunkSpec, StoreConfigError, TieredStore
from kvstore.config import STAGING_SIZE
from kvstore.index import IndexListener


class KVStoreConnector:
    def __init__(self, store: TieredStore, kv_cache: torch.Tensor, config: ConnectorConfig) -> None:
        self.store = store
        self.config = config
        self.geometry = ChunkGeometry(block_size=kv_cache.shape[3], chunk_tokens=config.kv_chunk_tokens)
        self.manager = store.manager
        self.planner = Planner(store.manager, store.transfers, self.geometry, config.kv_save_decode,
                               loads=config.loads, saves=config.saves)
        self.worker = Worker(store.transfers, kv_cache, self.geometry.block_size, store.manager.tier_names)
        self._unstarted: StepMeta | None = None  # built, not started yet
        self._started: StepMeta | None = None  # started, its saves not done yet
        self._saved = 0
        self._offloaded = 0

    @classmethod
    def from_config(
        cls, kv_cache: torch.Tensor, fingerprint: bytes, config: ConnectorConfig, staging_size: int = STAGING_SIZE
    ) -> KVStoreConnector:
        """Build the store for the engine's KV layout (`kv_cache` is the block-major
        device pool); `staging_size`: bytes of host slots when there is no cpu tier (with
        one, the slots touched up front)."""
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        try:
            spec = ChunkSpec.for_kv_layout(
                fingerprint, num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                head_dim=head_dim, dtype=kv_cache.dtype, chunk_tokens=config.kv_chunk_tokens,
            )
            store = TieredStore.from_config(spec, config, staging_size)
        except StoreConfigError as exc:
            raise ConnectorConfigError(str(exc), exc.option) from exc
        return cls(store, kv_cache, config)

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self.planner.match(request, num_computed_tokens)

    def num_stored_blocks(self, block_hashes: Sequence[bytes], start: int, end: int) -> int:
        return len(self.manager.locate(block_hashes, start, end)) if start < end else 0

    def probe_stored_blocks(self, block_hashes: Sequence[bytes], start: int, end: int) -> concurrent.futures.Future[int] | None:
        return self.manager.probe(block_hashes, start, end) if self.manager.has_remote_index else None

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.planner.allocated(request, block_ids, num_external_tokens, self.worker.copy_on_arrival)

    def build_meta(self, output: ScheduledBatch) -> StepMeta:
        meta = self.planner.build(output)
        if self._unstarted is not None:
            meta.offloads[:0] = self._unstarted.offloads
            meta.loads[:0] = self._unstarted.loads
        self._unstarted = meta
        return meta

    def take_load_tiers(self, request_id: str) -> list[tuple[str, int]]:
        return self.planner.take_load_tiers(request_id)

    def request_preempted(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        self.worker.seal(request.request_id)  # before its blocks are freed
        self.planner.preempted(request, block_ids)

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        self.worker.seal(request.request_id)
        self.planner.forget(request.request_id)

    def prefetch(self, requests: Sequence[ConnectorRequest]) -> None:
        self.planner.prefetch(requests)

    def get_finished(self) -> FinishedLoads:
        self.worker.poll()
        self.planner.close_abandoned()
        return self.planner.finished_loads()

    # ---- worker side ----------------------------------------------------------------------

    def start_load_kv(self, meta: StepMeta) -> None:
        if meta is self._unstarted:
            self._unstarted = None
        self._offloaded += self.worker.save(meta.offloads)
        for planned in meta.loads:
            if not planned.dropped:
                self.worker.load(planned)
        self._started = meta

    def wait_for_save(self) -> None:
        meta, self._started = self._started, None
        if meta is not None and meta.saves:
            self._saved += self.worker.save(meta.saves)

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a read task of an asynchronous load or prefetch, or a probe,
        completes, or one of them reaches its deadline, or `timeout_s`."""
        futures: list[concurrent.futures.Future] = []
        deadline = time.monotonic() + timeout_s
        pending = [p.load for p in self.planner.loading.values()]
        for state in self.planner.requests.values():
            if state.probe is not None:
                futures.append(state.probe)
            if state.prefetch is not None:
                pending.append(state.prefetch)
        for work in pending:
            futures += [f for f in work.futures if not f.done()]
            deadline = min(deadline, work.deadline)
        if futures:
            concurrent.futures.wait(futures, max(0.0, deadline - time.monotonic()), concurrent.futures.FIRST_COMPLETED)

    # ---- admin side -----------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        # what the tiers reported since the last step reaches the index, and the KV events,
        # while the engine idles too (the async engine reads stats every 0.5 s then)
        self.manager.poll()
        skipped = self.store.counters["save_skipped_records"]
        return connector_stats(
            self.planner.counters, self.worker.counters, (self._saved, self._offloaded, skipped),
            self.manager.tier_names,
        )

    def tier_stats(self) -> dict[str, dict]:
        loaded = self.worker.counters.loaded_tokens_by_tier
        return {name: tier_view(tier, loaded.get(name, 0)) for name, tier in self.store.stats().tiers.items()}

    def tier_health(self) -> dict[str, str]:
        """Each tier's health ("healthy" or "unhealthy"), read now (any thread)."""
        return self.store.health()

    def pin(self, block_hashes: Sequence[bytes], ttl_s: float | None) -> tuple[int, int]:
        keys = self.manager.chunk_keys(block_hashes, self.geometry.block_size)
        self.manager.pin(keys, ttl_s)
        return len(keys), sum(self.manager.has_record(k.name) for k in keys)

    def unpin(self, block_hashes: Sequence[bytes]) -> int:
        return self.manager.unpin(self.manager.chunk_keys(block_hashes, self.geometry.block_size))

    def flush(self, tiers: Sequence[str] | None) -> concurrent.futures.Future[dict[str, int]]:
        return self.store.flush(tiers)

    def make_resident(self) -> None:
        self.store.make_resident()

    def watch_blocks(self, listener: IndexListener) -> None:
        self.manager.index.watch(listener)

    def stored_blocks_in(self, block_hashes: Sequence[bytes], tier: str) -> int:
        run = self.manager.locate(block_hashes, 0, len(block_hashes))
        return next((i for i, place in enumerate(run) if tier not in place.record.tiers), len(run))

    def close(self) -> None:
        """Finish the copies in flight and close the store (which writes out what is
        pending); loads still open are dropped with it."""
        self.worker.drain()
        self.store.close()
