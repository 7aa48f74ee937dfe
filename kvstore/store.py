"""TieredStore: the content-addressed KV chunk store the connector talks to.

Threading model: the engine calls every public method from its own (synchronous) thread.
`lookup` answers synchronously from in-memory indexes (plus one pipelined EXISTS to Redis,
bounded by `lookup_timeout_s`); `load`, `save` and `prefetch` return
concurrent.futures.Future that the caller can poll with `.done()` and that cannot be
cancelled (they resolve when the store no longer touches the caller's buffers). I/O runs
on an asyncio loop in a daemon thread owned by the store.

Failure model: a missing, corrupt, foreign or unreadable chunk, a slow or dead tier, is a
miss (counted per tier), never an exception. Exceptions are raised only for misuse: a
tensor that does not match the ChunkSpec (ChunkSpecError) or a closed store
(StoreClosedError).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from kvstore.buffers import BufferPool
from kvstore.compression import resolve_codec
from kvstore.config import StoreConfig, build_tiers
from kvstore.errors import StoreClosedError, StoreConfigError
from kvstore.keys import ChunkKey, ChunkKeyer
from kvstore.loading import Loader, LoadResult
from kvstore.parts import StoreParts
from kvstore.record import RecordCodec
from kvstore.runtime import IoRuntime
from kvstore.saving import SaveResult, WriteBehind
from kvstore.spec import ChunkSpec
from kvstore.stats import StoreCounters, StoreSnapshot
from tiers.base import RecordTier, Tier
from tiers.cpu import CpuTier
from tiers.pins import PinTable
from tiers.redis_tier import RedisTier

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LookupResult:
    """The leading run of keys the store holds, and the tier each one is in."""

    tiers: tuple[str, ...]

    @property
    def num_chunks(self) -> int:
        return len(self.tiers)


class TieredStore:
    def __init__(
        self,
        spec: ChunkSpec,
        tiers: Sequence[Tier],
        config: StoreConfig | None = None,
        pins: PinTable | None = None,
    ) -> None:
        """Use `from_options` unless you build the tiers yourself (tests, tools)."""
        self.spec = spec
        self.config = config or StoreConfig()
        self.pins = pins or PinTable()
        self.tiers = list(tiers)
        self._check_tiers()
        for tier in self.tiers:
            tier.pins = self.pins
        self.keyer = ChunkKeyer(spec.fingerprint, spec.chunk_tokens)
        codec = resolve_codec(self.config.compress, spec.itemsize)
        self.codec = RecordCodec(spec, codec, self.config.secret_bytes)
        self.cpu = next((t for t in self.tiers if isinstance(t, CpuTier)), None)
        self.lower = [t for t in self.tiers if isinstance(t, RecordTier)]
        self.counters = StoreCounters()
        self._closed = False
        self._runtime = IoRuntime()
        buffers = BufferPool(self.codec.max_record_size, keep=self._pool_size())
        parts = StoreParts(self.codec, self.cpu, self.lower, self._runtime, self.counters, buffers)
        self._writer = WriteBehind(parts, self.config.max_pending_write_bytes)
        self._loader = Loader(parts, self.config.promote)
        self._writer.start(self.config.write_workers)
        for tier in self.lower:
            for name, factory in tier.workers():
                self._runtime.supervise(name, factory)

    @classmethod
    def from_options(cls, spec: ChunkSpec, **options: Any) -> TieredStore:
        """Build the store and its tiers from StoreConfig keyword options, e.g.
        `from_options(spec, tiers="cpu,disk", cpu_size=4 << 30, disk_path="/var/kv")`."""
        config = StoreConfig(**options)
        pins = PinTable()
        return cls(spec, build_tiers(spec, config, pins), config, pins)

    # keys ----------------------------------------------------------------------------

    def key(self, block_hash: bytes) -> ChunkKey:
        """The key of the chunk that ends with the block whose chained hash is given."""
        return self.keyer.key(block_hash)

    def chunk_keys(self, block_hashes: Sequence[bytes], block_size: int) -> list[ChunkKey]:
        """Keys of every complete chunk, given a request's full-block hashes in order."""
        return self.keyer.chunk_keys(block_hashes, self.spec.chunk_tokens // block_size)

    @property
    def tier_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tiers)

    # data path -------------------------------------------------------------------------

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """How many leading chunks are available, and where (a gap ends the run)."""
        self._check_open()
        found: list[str] = []
        try:
            found = self._lookup(keys)
        except Exception:
            self.counters.add(internal_errors=1)
            log.exception("kvstore lookup failed; reporting no hits")
        self.counters.add(lookups=1, lookup_chunks=len(keys), lookup_hit_chunks=len(found))
        return LookupResult(tuple(found))

    def load(
        self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor], timeout_s: float | None = None
    ) -> Future[LoadResult]:
        """Fill `outs` (caller-owned CPU tensors of the ChunkSpec) with the chunks of `keys`.

        Do not touch `outs` until the future is done; it always completes, within
        `timeout_s` (default `config.load_timeout_s`) plus one chunk's decode."""
        self._check_open()
        if len(keys) != len(outs):
            raise ValueError(f"{len(keys)} keys but {len(outs)} output tensors")
        for out in outs:
            self.spec.check_tensor(out)
        return self._loader.load(keys, outs, timeout_s or self.config.load_timeout_s)

    def save(self, keys: Sequence[ChunkKey], tensors: Sequence[torch.Tensor]) -> Future[SaveResult]:
        """Store chunks in every configured tier that does not hold them yet.

        The tensors are copied before this returns: the caller may reuse them at once.
        The future completes when the lower tiers (disk, redis) are written."""
        self._check_open()
        if len(keys) != len(tensors):
            raise ValueError(f"{len(keys)} keys but {len(tensors)} tensors")
        for tensor in tensors:
            self.spec.check_tensor(tensor)
        return self._writer.submit(keys, tensors)

    def prefetch(self, keys: Sequence[ChunkKey]) -> Future[int]:
        """Pull chunks from disk/redis into the cpu tier in the background; the future
        gives how many were fetched. A no-op without a cpu tier."""
        self._check_open()
        return self._loader.prefetch(keys, self.config.load_timeout_s)

    # control -----------------------------------------------------------------------------

    def pin(self, keys: Sequence[ChunkKey], ttl_s: float | None = None) -> None:
        """Never evict these chunks from the cpu and disk tiers (of this process) until
        `ttl_s` passes or they are unpinned. Keys may be pinned before they are saved."""
        self.pins.pin((k.name for k in keys), ttl_s)

    def unpin(self, keys: Sequence[ChunkKey]) -> int:
        return self.pins.unpin(k.name for k in keys)

    def delete(self, keys: Sequence[ChunkKey], timeout_s: float = 10.0) -> int:
        """Remove chunks from every tier; returns how many (tier, chunk) pairs existed.
        An admin call: it blocks, and raises TimeoutError past `timeout_s`."""
        self._check_open()
        names = [k.name for k in keys]
        return sum(self._runtime.call(tier.delete(names), timeout_s) for tier in self.tiers)

    def flush(self, tiers: Sequence[str] | None = None, timeout_s: float = 30.0) -> dict[str, int]:
        """Drop every unpinned chunk of this model and chunk size from the given tiers
        (default all); other models sharing a directory or Redis are left alone. An admin
        call: it blocks, and raises TimeoutError past `timeout_s`."""
        self._check_open()
        chosen = [t for t in self.tiers if tiers is None or t.name in tiers]
        return {
            t.name: self._runtime.call(t.clear(self.keyer.namespace), timeout_s) for t in chosen
        }

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every pending save is written; False on timeout."""
        self._check_open()
        try:
            self._runtime.call(self._writer.drain(), timeout_s)
        except TimeoutError:
            return False
        return True

    def stats(self) -> StoreSnapshot:
        tokens = self.spec.chunk_tokens
        return StoreSnapshot(
            chunk_tokens=tokens,
            counters=self.counters.values(),
            tiers={t.name: t.snapshot(tokens) for t in self.tiers},
            pinned_chunks=len(self.pins),
            pending_write_bytes=self._writer.pending_bytes,
            worker_restarts=self._runtime.restarts(),
        )

    def health(self) -> dict[str, str]:
        return {t.name: t.health.state.value for t in self.tiers}

    def probe_remote(self, timeout_s: float = 5.0) -> list[str]:
        """Probe every remote tier now (its health follows the answer); the names of
        those that did not answer. A dead tier keeps being probed in the background and
        comes back by itself."""
        down = []
        for tier in self.lower:
            if isinstance(tier, RedisTier):
                try:
                    answered = self._runtime.call(tier.probe(), timeout_s)
                except TimeoutError:
                    answered = False
                if not answered:
                    down.append(tier.name)
        return down

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish pending writes (up to `timeout_s`), then cancel what is left: a
        cancelled disk write leaves only a temporary file, never a torn record."""
        if self._closed:
            return
        if not self.drain(timeout_s):
            log.warning(
                "kvstore close: pending writes did not finish in %.1fs; cancelling", timeout_s
            )
        self._closed = True
        self._runtime.cancel_tasks(timeout_s)
        with contextlib.suppress(TimeoutError):
            self._runtime.call(self._close_tiers(), timeout_s)
        self._runtime.stop(timeout_s)
        self._writer.abandon_queued()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # internals ---------------------------------------------------------------------------

    def _lookup(self, keys: Sequence[ChunkKey]) -> list[str]:
        found: list[str] = []
        for index, key in enumerate(keys):
            tier = self._local_tier(key)
            if tier is None:
                return found + self._lookup_remote(keys[index:])
            found.append(tier)
        return found

    def _local_tier(self, key: ChunkKey) -> str | None:
        for tier in self.tiers:
            if tier.has_local(key.name):
                return tier.name
        return None

    def _lookup_remote(self, keys: Sequence[ChunkKey]) -> list[str]:
        """Continue the run through tiers that need I/O to answer (redis)."""
        remote = [t for t in self.lower if t.remote and t.health.available()]
        answers: list[list[bool]] = []
        for tier in remote:
            try:
                answers.append(
                    self._runtime.call(
                        tier.contains([k.name for k in keys]), self.config.lookup_timeout_s
                    )
                )
            except TimeoutError:
                tier.counters.add(errors=1)
                tier.health.record_failure(f"lookup took over {self.config.lookup_timeout_s}s")
                answers.append([False] * len(keys))
        found: list[str] = []
        for index, key in enumerate(keys):
            tier = self._local_tier(key) or next(
                (t.name for t, a in zip(remote, answers, strict=True) if a[index]), None
            )
            if tier is None:
                break
            found.append(tier)
        return found

    def _pool_size(self) -> int:
        """Idle record buffers to keep: what a full write-behind queue uses, at most 256."""
        per_record = self.codec.max_record_size
        return max(16, min(256, self.config.max_pending_write_bytes // per_record))

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("the KV store is closed")

    def _check_tiers(self) -> None:
        names = [t.name for t in self.tiers]
        if not names or len(set(names)) != len(names):
            raise StoreConfigError(f"a store needs distinct tiers, got {names}")
        if any(isinstance(t, CpuTier) for t in self.tiers[1:]):
            raise StoreConfigError("the cpu tier must come first")

    async def _close_tiers(self) -> None:
        results = await asyncio.gather(*(t.aclose() for t in self.tiers), return_exceptions=True)
        for tier, result in zip(self.tiers, results, strict=True):
            if isinstance(result, Exception):
                log.debug("closing the %s tier failed: %s", tier.name, result)
