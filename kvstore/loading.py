"""Loads into caller buffers, promotion into the cpu tier, and prefetch.

cpu-tier hits are copied in the caller's thread before `load` returns (a memcpy per
chunk), so a load served entirely from memory comes back as an already-finished future.
The rest is fetched on the I/O loop from the record tiers in order (disk, then redis),
each tier asked only for what is still missing, and decoded straight into the caller's
tensors. Decoding happens on the loop thread between awaits, so once the future is done
nothing writes to the caller's buffers any more; the future is resolved even on timeout
or shutdown (missing chunks are then misses). Any bad record is a counted miss and is
deleted from its tier before the load completes, so that it does not fail again and a
save of the recomputed chunk that follows finds the key free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvstore.errors import RecordError
from kvstore.keys import ChunkKey
from kvstore.parts import StoreParts
from kvstore.runtime import pending_future, resolved
from kvstore.spec import tensor_bytes
from tiers.base import Buffer, RecordTier
from tiers.cpu import ALREADY_PRESENT, NO_ROOM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadResult:
    """Per key, the tier that delivered the chunk, or None for a miss."""

    tiers: tuple[str | None, ...]

    @property
    def ok(self) -> tuple[bool, ...]:
        return tuple(t is not None for t in self.tiers)

    @property
    def num_leading_ok(self) -> int:
        """Chunks loaded before the first miss: what a prefix cache can use."""
        for index, tier in enumerate(self.tiers):
            if tier is None:
                return index
        return len(self.tiers)


@dataclass(eq=False)
class _Load:
    """One `load` call: its keys, the caller's tensors and, per key, the tier that
    delivered the chunk so far (None: not yet)."""

    keys: Sequence[ChunkKey]
    outs: Sequence[torch.Tensor]
    tiers: list[str | None]


class Loader:
    def __init__(self, parts: StoreParts, promote: bool) -> None:
        self._parts = parts
        self._promote = promote and parts.cpu is not None
        self._prefetching: dict[str, asyncio.Future[None]] = {}  # loop thread only

    def load(
        self, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor], timeout_s: float
    ) -> Future[LoadResult]:
        job = _Load(keys, outs, [None] * len(keys))
        rest = [i for i in range(len(keys)) if not self._from_cpu(job, i)]
        self._parts.counters.add(loads=1, load_chunks=len(keys))
        if not rest or not self._parts.lower:
            return resolved(self._finish(job))
        future: Future[LoadResult] = pending_future()
        self._parts.runtime.spawn(self._load_rest(job, rest, timeout_s, future))
        return future

    def prefetch(self, keys: Sequence[ChunkKey], timeout_s: float) -> Future[int]:
        if self._parts.cpu is None or not self._parts.lower:
            return resolved(0)
        future: Future[int] = pending_future()
        self._parts.runtime.spawn(self._prefetch(list(keys), timeout_s, future))
        return future

    def _from_cpu(self, job: _Load, i: int) -> bool:
        cpu = self._parts.cpu
        if cpu is None:
            return False
        if cpu.get_into(job.keys[i].name, job.outs[i]):
            cpu.counters.add(hits=1)
            job.tiers[i] = cpu.name
            return True
        cpu.counters.add(misses=1)
        return False

    def _finish(self, job: _Load) -> LoadResult:
        self._parts.counters.add(load_hit_chunks=sum(t is not None for t in job.tiers))
        return LoadResult(tuple(job.tiers))

    @contextlib.asynccontextmanager
    async def _bounded(self, what: str, timeout_s: float) -> AsyncIterator[None]:
        """Run the body for at most `timeout_s`. A timeout is logged, a failure logged and
        counted; neither is raised: the chunks not fetched by then are misses."""
        try:
            async with asyncio.timeout(timeout_s):
                yield
        except TimeoutError:
            log.warning("kvstore %s timed out after %.3fs; missing chunks are misses", what, timeout_s)
        except Exception:
            self._parts.counters.add(internal_errors=1)
            log.exception("kvstore %s failed; missing chunks are misses", what)

    async def _load_rest(
        self, job: _Load, rest: list[int], timeout_s: float, future: Future[LoadResult]
    ) -> None:
        """Fill the chunks at indices `rest` from the record tiers; the future is resolved
        whatever happens."""
        try:
            async with self._bounded("load", timeout_s):
                await self._fill(job, rest)
        finally:
            future.set_result(self._finish(job))

    async def _fill(self, job: _Load, rest: list[int]) -> None:
        keys, outs, tiers = job.keys, job.outs, job.tiers
        waits = [self._prefetching[keys[i].name] for i in rest if keys[i].name in self._prefetching]
        if waits:
            await asyncio.wait(waits)
            rest = [i for i in rest if not self._from_cpu(job, i)]
        for tier in self._parts.lower:
            ask = [i for i in rest if tier.has_local(keys[i].name) is not False]
            if not ask:
                continue
            buffers = [self._parts.buffers.take() for _ in ask]
            records = await tier.get([keys[i].name for i in ask], buffers)
            bad: list[str] = []
            for i, record in zip(ask, records, strict=True):
                if self._decode(tier, keys[i], record, tensor_bytes(outs[i]), bad):
                    tiers[i] = tier.name
            self._give_back(buffers)
            await self._delete(tier, bad)
            rest = [i for i in rest if tiers[i] is None]
            if not rest:
                break
        if self._promote:
            loaded = [i for i, t in enumerate(tiers) if t not in (None, self._parts.cpu.name)]
            promoted = sum(self._parts.cpu.put_from(keys[i].name, outs[i]) for i in loaded)
            self._parts.counters.add(promotions=promoted)

    async def _prefetch(self, keys: list[ChunkKey], timeout_s: float, future: Future[int]) -> None:
        todo = [
            k for k in keys if not self._parts.cpu.has_local(k.name) and k.name not in self._prefetching
        ]
        mine = {k.name for k in todo}
        for name in mine:
            self._prefetching[name] = asyncio.get_running_loop().create_future()
        fetched = 0
        try:
            async with self._bounded("prefetch", timeout_s):
                for tier in self._parts.lower:
                    todo, count = await self._prefetch_from(tier, todo)
                    fetched += count
        finally:
            for name in mine:
                self._prefetching.pop(name).set_result(None)
            self._parts.counters.add(prefetch_chunks=fetched)
            future.set_result(fetched)

    async def _prefetch_from(
        self, tier: RecordTier, todo: list[ChunkKey]
    ) -> tuple[list[ChunkKey], int]:
        """Decode what `tier` has straight into cpu slots; returns (still missing, fetched)."""
        ask = [k for k in todo if tier.has_local(k.name) is not False]
        if not ask:
            return todo, 0
        buffers = [self._parts.buffers.take() for _ in ask]
        records = await tier.get([k.name for k in ask], buffers)
        done: set[str] = set()
        fetched = 0
        bad: list[str] = []
        for key, record in zip(ask, records, strict=True):
            outcome = self._into_cpu(tier, key, record, bad)
            if outcome is not None:
                done.add(key.name)
                fetched += outcome
        self._give_back(buffers)
        await self._delete(tier, bad)
        return [k for k in todo if k.name not in done], fetched

    def _into_cpu(
        self, tier: RecordTier, key: ChunkKey, record: Buffer | None, bad: list[str]
    ) -> int | None:
        """Decode `record` into a new cpu slot: 1 if stored, 0 if already there, None if not."""
        if record is None:
            tier.counters.add(misses=1)
            return None
        slot = self._parts.cpu.reserve(key.name)
        if slot == ALREADY_PRESENT:
            return 0
        if slot == NO_ROOM:
            return None
        if not self._decode(tier, key, record, self._parts.cpu.buffer(slot), bad):
            self._parts.cpu.abort(slot)
            return None
        self._parts.cpu.commit(slot)
        return 1

    def _give_back(self, buffers: list[bytearray]) -> None:
        """Recycle read buffers once decoded. Not done when a read is interrupted: an
        I/O thread may still be filling them."""
        for buffer in buffers:
            self._parts.buffers.give(buffer)

    @staticmethod
    async def _delete(tier: RecordTier, bad: list[str]) -> None:
        if bad:
            await tier.delete(bad)

    def _decode(
        self, tier: RecordTier, key: ChunkKey, record: Buffer | None, out: memoryview,
        bad: list[str],
    ) -> bool:
        """Verify `record` into `out`; a bad record is counted and its key added to `bad`."""
        if record is None:
            tier.counters.add(misses=1)
            return False
        try:
            self._parts.codec.decode_into(key.block_hash, record, out)
        except RecordError as exc:
            tier.counters.add(misses=1, **{exc.counter: 1})
            log.warning(
                "kvstore: bad record %s in %s tier (%s: %s); deleting it",
                key.name,
                tier.name,
                type(exc).__name__,
                exc,
            )
            bad.append(key.name)
            return False
        tier.counters.add(hits=1)
        return True
