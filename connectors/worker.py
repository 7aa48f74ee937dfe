"""The worker side of the store connector: executes the planner's plans through the
store's transfers (kvstore.transfers), moving bytes between the store's host slots and
the device KV cache, one copy each way.

- A load: every part of it (a run of blocks of one record, in a slot) is copied slot ->
  device blocks, up to the blocks that arrived; then the load is closed (a record read
  from disk or Redis stays in the cpu tier, in the slot it was read into). On a CPU
  cache, the worker chooses to copy the parts of an asynchronous load as they arrive,
  while the request waits for the others (`copy_on_arrival`: a callback of its own on
  each read task's future, run on the read thread that finished); the step copies only
  what was in before. When the store does not keep the records it reads (no cpu tier to
  promote into), the worker offers each part its device blocks (`Load.offer`): a record
  the tier can read without waiting goes straight there, claiming its part as a copy
  does. The request owns its device blocks until it is freed, and every copy into them
  ends before `seal` returns, which runs before they are freed or read.
- A save: a slot is reserved for the record, the device blocks are copied into its
  payload, and once that copy is done the slot is committed (cpu tier, write-behind).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from connectors.planner import PlannedLoad, SavePlan
from connectors.transfer import BlockCopier, CopyEvent
from kvstore import Load, Transfers


@dataclass
class WorkerCounters:
    loaded_tokens_by_tier: dict[str, int]
    loaded_tokens: int = 0
    load_copy_seconds: float = 0.0  # slots -> device blocks
    save_copy_seconds: float = 0.0  # device blocks -> slots


@dataclass(eq=False)
class ArrivalCopies:
    """The parts of one asynchronous load copied into its device blocks as they arrive:
    parts are copied concurrently (each claims its own), and `seal` waits for the copies
    under way and refuses new ones."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    copied: set[int] = field(default_factory=set)  # part indexes
    claimed: set[int] = field(default_factory=set)  # copied, or being copied
    active: int = 0  # copies under way
    sealed: bool = False  # no more copies: the load is being copied by the step, or dropped

    def __post_init__(self) -> None:
        self.idle = threading.Condition(self.lock)

    def claim(self, index: int) -> bool:
        """Part `index` is to be copied now; False if it was, or the load is sealed."""
        with self.lock:
            if self.sealed or index in self.claimed:
                return False
            self.claimed.add(index)
            self.active += 1
            return True

    def finish(self, index: int, copied: bool) -> None:
        with self.lock:
            if copied:
                self.copied.add(index)
            else:
                self.claimed.discard(index)
            self.active -= 1
            self.idle.notify_all()

    def seal(self) -> set[int]:
        """No copy from now on; waits for those under way. The parts copied."""
        with self.lock:
            self.sealed = True
            while self.active:
                self.idle.wait()
            return set(self.copied)


@dataclass(eq=False)
class BlockDestination:
    """A part's device blocks of a CPU cache, offered to the read of its record
    (kvstore.loading.Destination): claimed like a copy, so that `seal` waits for it."""

    copies: ArrivalCopies
    index: int  # of the part in its load
    position: int  # of the part's first block in its record
    claimed_blocks: Callable[[int], list[int]]
    block_memory: Callable[[int], memoryview]

    def claim(self) -> Mapping[int, memoryview] | None:
        blocks = self.claimed_blocks(self.index)
        if not blocks:
            return None
        return {self.position + j: self.block_memory(block) for j, block in enumerate(blocks)}

    def release(self, placed: bool) -> None:
        self.copies.finish(self.index, placed)


class Worker:
    def __init__(self, transfers: Transfers, kv_cache: torch.Tensor, block_size: int, tier_names: Sequence[str]) -> None:
        self.transfers = transfers
        self.block_size = block_size
        self.copier = BlockCopier(kv_cache)
        self.counters = WorkerCounters({name: 0 for name in tier_names})
        self._arriving: dict[str, ArrivalCopies] = {}  # by request id
        self._block_rows: np.ndarray | None = None  # a CPU cache's blocks as bytes (`_block_memory`)

    def copy_on_arrival(self, planned: PlannedLoad) -> None:
        """Copy each part of an admitted asynchronous load into its device blocks as soon
        as it arrives (CPU cache only), until `seal`."""
        if not self.copier.copies_from_any_thread:
            return
        load: Load = planned.load  # type: ignore[assignment]
        copies = self._arriving[planned.request_id] = ArrivalCopies()
        offsets = list(itertools.accumulate((part.count for part in load.parts), initial=0))

        def claimed_blocks(index: int) -> list[int]:
            """The promised device blocks of part `index`, claimed for a copy ([]: none to
            copy, or not now); the caller then calls `copies.finish`."""
            first = offsets[index]
            count = min(load.parts[index].count, planned.promised_blocks - first)
            return planned.block_ids[first : first + count] if count > 0 and copies.claim(index) else []

        def arrived(index: int) -> None:
            if load.part_tier(index) is None:
                return
            blocks = claimed_blocks(index)
            if not blocks:
                return
            copied = False
            try:
                self.copier.to_device_off_engine_thread(self.transfers.view(load.parts[index])[: len(blocks)], blocks)
                copied = True
            finally:
                copies.finish(index, copied)

        if not self.transfers.keeps_loaded_records:
            for index, part in enumerate(load.parts):
                load.offer(index, BlockDestination(copies, index, part.position, claimed_blocks, self._block_memory))
        load.start()
        for index in range(len(load.parts)):
            arrival = load.arrival(index)
            if arrival is not None:
                arrival.add_done_callback(lambda _, index=index: arrived(index))

    def _block_memory(self, block: int) -> memoryview:
        """Device block `block` of a CPU cache as writable bytes."""
        if self._block_rows is None:
            cache = self.copier.kv_cache
            self._block_rows = cache.view(-1).view(torch.uint8).view(cache.shape[0], -1).numpy()
        return memoryview(self._block_rows[block])

    def seal(self, request_id: str) -> set[int]:
        """Stop copying the request's load as it arrives; once this returns no such copy
        is running. The indexes of the parts copied."""
        copies = self._arriving.pop(request_id, None)
        return set() if copies is None else copies.seal()

    def load(self, planned: PlannedLoad) -> None:
        """Copy the blocks of a done load that arrived into its device blocks (but for the
        parts copied as they arrived), then close it."""
        started = time.perf_counter()
        load: Load = planned.load  # type: ignore[assignment]
        copied = self.seal(planned.request_id)
        left = planned.promised_blocks
        event = None
        offset = 0
        for index, part in enumerate(load.parts):
            tier = load.part_tier(index)
            if left <= 0 or tier is None:
                break
            count = min(part.count, left)
            if index not in copied:
                event = self.copier.to_device(
                    self.transfers.view(part)[:count], planned.block_ids[offset : offset + count]
                )
            tokens = count * self.block_size
            self.counters.loaded_tokens_by_tier[tier] = self.counters.loaded_tokens_by_tier.get(tier, 0) + tokens
            self.counters.loaded_tokens += tokens
            offset += count
            left -= count
        seconds = time.perf_counter() - started
        self._after(event, lambda: self.transfers.close_load(load, seconds))
        self.counters.load_copy_seconds += seconds

    def save(self, plans: list[SavePlan]) -> int:
        """Copy records out of the device cache into slots; how many were taken (a record
        the store already holds, or for which no slot is free, is skipped; the store
        counts the latter)."""
        started = time.perf_counter()
        taken = 0
        for plan in plans:
            key = self.transfers.key(plan.block_hashes, plan.first_block)
            slot = self.transfers.reserve(key)
            if slot is None:
                continue
            copy_started = time.perf_counter()
            event = self.copier.from_device(plan.block_ids, self.transfers.payload(slot, key.num_blocks))
            seconds = time.perf_counter() - copy_started
            self._after(event, lambda slot=slot, key=key, seconds=seconds: self.transfers.commit(slot, key, seconds))
            taken += 1
        self.counters.save_copy_seconds += time.perf_counter() - started
        return taken

    def poll(self) -> None:
        self.copier.poll()

    def drain(self) -> None:
        self.copier.drain()

    def _after(self, event: CopyEvent | None, callback) -> None:
        if event is None:
            callback()
        else:
            self.copier.when_done(event, callback)
