"""KVStoreConnector: the connector interface (connectors/base.py) on kvstore.TieredStore.

Loads. At admission `get_num_new_matched_tokens` looks up the request's chunks from the
one holding its first token not on the device (full chunks, then the tail chunk of
connectors/chunks.py when its loadable tokens end inside a chunk), and starts
`store.load` of that run
into host staging owned by a `LoadJob`. Chunks in the cpu tier are copied before `load`
returns, so when its future is already done the answer is synchronous and exact (what
really arrived); the job's blocks are written into the device cache by `start_load_kv`
before the step's forward. Otherwise (disk, redis) the answer is asynchronous: the
request waits in WAITING_FOR_REMOTE_KV, `get_finished` writes the blocks once the future
is done and reports the tokens that arrived. Only the leading run of loaded chunks
counts; the rest is recomputed in blocks the request already holds. The store resolves
every load future within the load timeout (missing chunks are then misses) and never
touches the staging after that. A job dropped before its future is done (its request
was aborted, or another request took its turn) is abandoned: it never writes into the
device cache, and its staging is freed once the future is done.

A job is started before the scheduler knows whether the request fits. If allocation
fails, the job waits in `_pending` for the next attempt of the same request (an
asynchronous load keeps running meanwhile); any other request's lookup drops it.

Saves. `build_meta` lists, for every scheduled request, the chunks this step completes
(prompt chunks, and the prompt's tail chunk once its prefill is done; full output chunks
too with save_decode) that are not known to be stored;
`wait_for_save` gathers them out of the device cache after the forward and hands them
to `store.save`, which copies into the cpu tier and writes disk and redis in the
background. Chunks count as stored when they were in the store's lookup run at
admission, or lay inside the device hit (they were saved when first computed). A tail
record keeps the chunk shape with zeros after the tail, so the slab, disk and redis
tiers keep one record size; the zeros compress away with --kv-compress. Because
the gather happens before `update_from_output` frees a finished request's blocks (and,
on CUDA, the compute stream waits for the copy), `request_finished` never needs to keep
blocks.

Preemption (offload mode): `request_preempted` gathers every computed full chunk the
store does not hold, and the tail chunk of the remaining full blocks, and saves them
before the scheduler frees the blocks; the resumed request finds them through the normal
lookup (when it was preempted in decode, its loadable end is where its KV ended). Only
the last partial block is recomputed.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from connectors.base import (
    ConnectorConfigError,
    ConnectorRequest,
    FinishedTransfers,
    ScheduledBatch,
)
from connectors.chunks import ChunkGeometry, ChunkSave, LoadJob, StepMeta
from connectors.stats import ConnectorCounters, tier_view
from connectors.transfer import BlockTransfer, HostChunk
from kernels.staging import CopyEvent
from kvstore import ChunkKey, ChunkSpec, StoreConfig, StoreConfigError, TieredStore

CPU_TIER = "cpu"


@dataclass(frozen=True)
class ConnectorSettings:
    chunk_tokens: int
    save_decode: bool = False
    load_timeout_s: float = StoreConfig.load_timeout_s
    staging_chunks: int = 64  # host staging buffers of one chunk each


class KVStoreConnector:
    def __init__(self, store: TieredStore, kv_cache: torch.Tensor, settings: ConnectorSettings) -> None:
        self.store = store
        self.settings = settings
        self.geometry = ChunkGeometry(block_size=kv_cache.shape[3], chunk_tokens=settings.chunk_tokens)
        self.transfer = BlockTransfer(kv_cache, self.geometry.blocks_per_chunk, settings.staging_chunks)
        self.counters = ConnectorCounters()
        tiers = store.tier_names
        self._can_prefetch = CPU_TIER in tiers and len(tiers) > 1
        self._pending: LoadJob | None = None
        self._ready: list[LoadJob] = []
        self._loading: dict[str, LoadJob] = {}
        self._abandoned: list[LoadJob] = []
        self._save_from: dict[str, int] = {}
        self._tail_done: set[str] = set()  # the prompt's tail chunk is stored or saved
        self._prefetched: set[str] = set()
        self._meta: StepMeta | None = None

    @classmethod
    def from_options(
        cls, kv_cache: torch.Tensor, fingerprint: bytes, settings: ConnectorSettings, **store_options
    ) -> KVStoreConnector:
        """Build the store for the engine's KV layout (`kv_cache` is the block-major
        device pool) from kvstore.StoreConfig options."""
        _, num_layers, _, block_size, num_kv_heads, head_dim = kv_cache.shape
        try:
            spec = ChunkSpec.for_kv_layout(
                fingerprint, num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads,
                head_dim=head_dim, dtype=kv_cache.dtype, chunk_tokens=settings.chunk_tokens,
            )
            store = TieredStore.from_options(spec, **store_options)
        except StoreConfigError as exc:
            raise ConnectorConfigError(str(exc), exc.option) from exc
        return cls(store, kv_cache, settings)

    # ---- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int, bool]:
        job = self._take_pending(request.request_id, num_computed_tokens)
        if job is None:
            job = self._start_load(request, num_computed_tokens)
        if job is None:
            return 0, False
        job.is_async = not job.future.done()  # read once: it may complete meanwhile
        if not job.is_async:
            self._settle(job)
        if job.num_tokens == 0:
            self._discard(job)
            return 0, False
        self._pending = job
        return job.num_tokens, job.is_async

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self._prefetched.discard(request.request_id)
        job, self._pending = self._pending, None
        if job is None:
            return
        if job.request_id != request.request_id or num_external_tokens <= 0:
            self._discard(job)
            return
        bs = self.geometry.block_size
        job.end_token = job.start_token + min(num_external_tokens, job.num_tokens)
        job.block_ids = list(block_ids[job.start_token // bs : job.end_token // bs])
        if job.is_async:
            self._loading[request.request_id] = job
            self.counters.async_loads += 1
        else:
            self._ready.append(job)

    def build_meta(self, output: ScheduledBatch) -> StepMeta:
        meta = StepMeta(loads=self._ready, saves=self._completed_chunks(output))
        self._ready = []
        return meta

    def request_preempted(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        self._forget(request.request_id)
        computed = request.num_computed_tokens
        full = self._computed_chunks(request, computed)
        saves = [
            ChunkSave(key, self.geometry.chunk_blocks(block_ids, c))
            for c, key in enumerate(self._chunk_keys(request, 0, full))
        ]
        tail = self._tail_save(request, block_ids, computed // self.geometry.block_size)
        saves += [tail] if tail is not None else []
        stored = self.store.lookup([s.key for s in saves]).num_chunks if saves else 0
        self.counters.offloaded_chunks += self._save(saves[stored:])

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> bool:
        self._forget(request.request_id)
        return False

    def prefetch(self, requests: Sequence[ConnectorRequest]) -> None:
        if not self._can_prefetch:
            return
        loading = self._pending.request_id if self._pending is not None else None
        for request in requests:
            if request.request_id in self._prefetched or request.request_id == loading:
                continue
            self._prefetched.add(request.request_id)
            keys = self._lookup_keys(request, 0)
            if not keys:
                continue
            found = self.store.lookup(keys)
            remote = [key for key, tier in zip(keys, found.tiers, strict=False) if tier != CPU_TIER]
            if remote:
                self.store.prefetch(remote)
                self.counters.prefetched_requests += 1

    # ---- worker side ----------------------------------------------------------------------

    def start_load_kv(self, meta: StepMeta) -> None:
        self._meta = meta
        for job in meta.loads:
            self._scatter(job)

    def wait_for_save(self) -> None:
        meta, self._meta = self._meta, None
        if meta is not None and meta.saves:
            self.counters.saved_chunks += self._save(meta.saves)

    def get_finished(self) -> FinishedTransfers:
        self.transfer.poll()
        self._reap_abandoned()
        loaded: dict[str, int] = {}
        for request_id, job in list(self._loading.items()):
            if job.future.done():
                del self._loading[request_id]
                self._settle(job)
                self._scatter(job)
                loaded[request_id] = job.num_tokens
        return set(), loaded

    def wait_for_loads(self, timeout_s: float) -> None:
        futures = [job.future for job in self._loading.values()]
        if futures:
            concurrent.futures.wait(futures, timeout_s, concurrent.futures.FIRST_COMPLETED)

    # ---- admin side -----------------------------------------------------------------------

    def stats(self) -> dict[str, int | float]:
        return self.counters.as_stats(self.store.tier_names)

    def tier_stats(self) -> dict[str, dict]:
        return {name: tier_view(tier) for name, tier in self.store.stats().tiers.items()}

    def tier_health(self) -> dict[str, str]:
        """Each tier's health ("healthy" or "unhealthy"), read now (any thread)."""
        return self.store.health()

    def pin(self, block_hashes: Sequence[bytes], ttl_s: float | None) -> int:
        keys = self.store.chunk_keys(block_hashes, self.geometry.block_size)
        self.store.pin(keys, ttl_s)
        return len(keys)

    def unpin(self, block_hashes: Sequence[bytes]) -> int:
        return self.store.unpin(self.store.chunk_keys(block_hashes, self.geometry.block_size))

    def flush(self, tiers: Sequence[str] | None) -> dict[str, int]:
        return self.store.flush(tiers)

    def close(self) -> None:
        """Finish the copies in flight, drop the loads, and close the store (which
        writes out what is pending)."""
        self.transfer.drain()
        for job in [*self._loading.values(), *self._ready, *filter(None, [self._pending])]:
            self._discard(job)
        self._loading.clear()
        self._ready, self._pending = [], None
        self.store.close()

    # ---- loads ----------------------------------------------------------------------------

    def _start_load(self, request: ConnectorRequest, start: int) -> LoadJob | None:
        """Look up the chunks after the device hit and start loading their leading run."""
        C = self.geometry.chunk_tokens
        first = start // C
        limit = self.geometry.loadable_end(request.num_tokens)
        keys = self._lookup_keys(request, first)
        found = self.store.lookup(keys).num_chunks if keys else 0
        full_chunks = self.geometry.num_full_chunks(request.block_hashes)
        self._save_from[request.request_id] = min(first + found, full_chunks)
        if start >= limit or first + found > full_chunks:
            self._tail_done.add(request.request_id)
        end = min(limit, (first + found) * C)
        if end <= start:
            return None
        chunks = self.transfer.acquire(-(-end // C) - first)
        end = min(end, (first + len(chunks)) * C)
        if end <= start:
            self.transfer.release(chunks)
            return None
        future = self.store.load(keys[: len(chunks)], [c.tensor for c in chunks], self.settings.load_timeout_s)
        return LoadJob(request.request_id, first, start, end, chunks, future, is_async=False)

    def _settle(self, job: LoadJob) -> None:
        """Cut a finished job down to the tokens that arrived; count the shortfall. The
        chunks that did not arrive are recomputed, so they are saved again (a bad record
        was deleted, a lost one is gone)."""
        loaded_end = job.loaded_end(job.future.result(), self.geometry)
        self._count_failure(job.end_token - loaded_end)
        if loaded_end < job.end_token:
            resume = loaded_end // self.geometry.chunk_tokens
            self._save_from[job.request_id] = min(self._save_from.get(job.request_id, resume), resume)
            self._tail_done.discard(job.request_id)
        job.end_token = loaded_end

    def _scatter(self, job: LoadJob) -> None:
        """Write a settled job's tokens into its device blocks, then free its staging."""
        started = time.perf_counter()
        event = None
        for index, blocks, dst in job.scatter_plan(job.end_token, self.geometry):
            event = self.transfer.scatter(job.chunks[index].tensor[blocks], dst)
        self._release_after(event, job.chunks)
        result = job.future.result()
        for tier, tokens in job.tokens_by_tier(result, job.end_token, self.geometry).items():
            self.counters.loaded_tokens_by_tier[tier] += tokens
            self.counters.loaded_tokens += tokens
        self.counters.load_copy_seconds += time.perf_counter() - started

    def _take_pending(self, request_id: str, start: int) -> LoadJob | None:
        """The pending job if it belongs to this request at this start; else drop it."""
        job, self._pending = self._pending, None
        if job is not None and (job.request_id != request_id or job.start_token != start):
            self._discard(job)
            job = None
        return job

    def _discard(self, job: LoadJob) -> None:
        """Drop a job that will never write the device cache; its staging is freed as
        soon as the store no longer touches it."""
        if job.future.done():
            self.transfer.release(job.chunks)
        else:
            self._abandoned.append(job)

    def _reap_abandoned(self) -> None:
        still = []
        for job in self._abandoned:
            if job.future.done():
                self.transfer.release(job.chunks)
            else:
                still.append(job)
        self._abandoned = still

    def _count_failure(self, missing_tokens: int) -> None:
        if missing_tokens > 0:
            self.counters.load_failures += 1
            self.counters.load_failed_tokens += missing_tokens

    # ---- saves ----------------------------------------------------------------------------

    def _completed_chunks(self, output: ScheduledBatch) -> list[ChunkSave]:
        """Chunks whose KV this step completes and that the store is not known to hold."""
        saves: list[ChunkSave] = []
        for request, block_ids in zip(output.requests, output.block_tables, strict=True):
            limit = request.num_computed_tokens
            if not self.settings.save_decode:
                limit = min(limit, request.num_prompt_tokens)
            upto = self._computed_chunks(request, limit)
            start = self._save_from.get(request.request_id, upto)
            if start < upto:
                keys = self._chunk_keys(request, start, upto)
                saves += [ChunkSave(key, self.geometry.chunk_blocks(block_ids, start + i)) for i, key in enumerate(keys)]
                self._save_from[request.request_id] = upto
            tail = self._prompt_tail_save(request, block_ids)
            saves += [tail] if tail is not None else []
        return saves

    def _prompt_tail_save(self, request: ConnectorRequest, block_ids: list[int]) -> ChunkSave | None:
        """The prompt's tail chunk, once its prefill is done, unless it is known stored."""
        if request.request_id in self._tail_done or request.num_computed_tokens < request.num_prompt_tokens:
            return None
        self._tail_done.add(request.request_id)
        end = self.geometry.tail_end(request.num_prompt_tokens)
        return None if end is None else self._tail_save(request, block_ids, end)

    def _tail_save(self, request: ConnectorRequest, block_ids: list[int], end_block: int) -> ChunkSave | None:
        """The tail chunk of the request's full blocks before `end_block`, if any."""
        blocks = self.geometry.tail_blocks(end_block)
        if blocks is None:
            return None
        key = self.store.key(request.block_hashes[end_block - 1])
        return ChunkSave(key, tuple(block_ids[blocks.start : blocks.stop]))

    def _save(self, saves: list[ChunkSave]) -> int:
        """Copy chunks out of the device cache and hand them to the store; returns how
        many were taken (the rest is skipped when staging runs dry)."""
        if not saves:
            return 0
        started = time.perf_counter()
        chunks = self.transfer.acquire(len(saves))
        self.counters.save_skipped_chunks += len(saves) - len(chunks)
        saves = saves[: len(chunks)]
        event = None
        for save, chunk in zip(saves, chunks, strict=True):
            count = len(save.block_ids)
            chunk.tensor[count:].zero_()  # a tail chunk: no stale KV of another request
            event = self.transfer.gather(save.block_ids, chunk.tensor[:count])
        if event is not None:
            self.transfer.when_done(event, lambda: self._hand_to_store(saves, chunks))
        self.counters.save_copy_seconds += time.perf_counter() - started
        return len(saves)

    def _hand_to_store(self, saves: list[ChunkSave], chunks: list[HostChunk]) -> None:
        """store.save copies the tensors before it returns, so staging is free after."""
        try:
            self.store.save([s.key for s in saves], [c.tensor for c in chunks])
        finally:
            self.transfer.release(chunks)

    def _release_after(self, event: CopyEvent | None, chunks: list[HostChunk]) -> None:
        if event is None:
            self.transfer.release(chunks)
        else:
            self.transfer.when_done(event, lambda: self.transfer.release(chunks))

    # ---- helpers --------------------------------------------------------------------------

    def _chunk_keys(self, request: ConnectorRequest, first: int, last: int) -> list[ChunkKey]:
        hashes = request.block_hashes
        return [self.store.key(self.geometry.end_hash(hashes, c)) for c in range(first, last)]

    def _lookup_keys(self, request: ConnectorRequest, first: int) -> list[ChunkKey]:
        """Keys of the chunks from `first` on that can supply loadable tokens: full
        chunks, then the tail chunk when the loadable tokens end inside a chunk."""
        limit = self.geometry.loadable_end(request.num_tokens)
        last = min(-(-limit // self.geometry.chunk_tokens), self.geometry.num_full_chunks(request.block_hashes))
        keys = self._chunk_keys(request, first, last)
        tail = self.geometry.tail_end(request.num_tokens)
        if tail is not None:
            keys.append(self.store.key(request.block_hashes[tail - 1]))
        return keys

    def _computed_chunks(self, request: ConnectorRequest, num_tokens: int) -> int:
        """Full chunks within the first `num_tokens` tokens that have a key."""
        return min(num_tokens // self.geometry.chunk_tokens, self.geometry.num_full_chunks(request.block_hashes))

    def _forget(self, request_id: str) -> None:
        self._save_from.pop(request_id, None)
        self._tail_done.discard(request_id)
        self._prefetched.discard(request_id)
        if self._pending is not None and self._pending.request_id == request_id:
            self._discard(self._pending)
            self._pending = None
        job = self._loading.pop(request_id, None)
        if job is not None:
            self._discard(job)
        for job in [j for j in self._ready if j.request_id == request_id]:
            self._ready.remove(job)
            self._discard(job)
