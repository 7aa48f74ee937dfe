"""The worker side of the store connector: executes the planner's plans, moving bytes
between the store's host slots and the device KV cache, one copy each way.

- A load: every part of it (a run of blocks of one record, in a slot) is copied slot ->
  device blocks, up to the blocks that arrived; then the load is closed (a record read
  from disk or Redis stays in the cpu tier, in the slot it was read into). On a CPU
  cache, the parts of an asynchronous load are copied as they arrive, on the store's I/O
  thread, while the request waits for the others (`copy_on_arrival`); the step copies
  only what was in before. The request owns its device blocks until it is freed, and
  every copy into them ends before `seal` returns, which runs before they are freed or
  read.
- A save: a slot is reserved for the record, the device blocks are copied into its
  payload, and once that copy is done the slot is committed (cpu tier, write-behind).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import torch

from connectors.planner import PlannedLoad, SavePlan
from connectors.transfer import BlockCopier, CopyEvent
from kvstore import Load, TieredStore


@dataclass
class WorkerCounters:
    loaded_tokens_by_tier: dict[str, int]
    loaded_tokens: int = 0
    load_copy_seconds: float = 0.0  # slots -> device blocks
    save_copy_seconds: float = 0.0  # device blocks -> slots


@dataclass(eq=False)
class ArrivalCopies:
    """The parts of one asynchronous load already copied into its device blocks."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    copied: set[int] = field(default_factory=set)  # part indexes
    sealed: bool = False  # no more copies: the load is being copied by the step, or dropped


class Worker:
    def __init__(self, store: TieredStore, kv_cache: torch.Tensor, block_size: int) -> None:
        self.store = store
        self.block_size = block_size
        self.copier = BlockCopier(kv_cache)
        self.counters = WorkerCounters({name: 0 for name in store.tier_names})
        self._arriving: dict[str, ArrivalCopies] = {}  # by request id

    def copy_on_arrival(self, planned: PlannedLoad) -> None:
        """Copy each part of an admitted asynchronous load into its device blocks as soon
        as it arrives (CPU cache only), until `seal`."""
        if not self.copier.copies_from_any_thread:
            return
        load: Load = planned.load  # type: ignore[assignment]
        copies = self._arriving[planned.request_id] = ArrivalCopies()
        offsets = list(itertools.accumulate((part.count for part in load.parts), initial=0))

        def arrived(index: int) -> None:
            part, first = load.parts[index], offsets[index]
            with copies.lock:
                count = min(part.count, planned.promised_blocks - first)
                if copies.sealed or count <= 0:
                    return
                block_ids = planned.block_ids[first : first + count]
                self.copier.to_device_off_engine_thread(self.store.view(part)[:count], block_ids)
                copies.copied.add(index)

        load.on_arrival(arrived)

    def seal(self, request_id: str) -> set[int]:
        """Stop copying the request's load as it arrives; once this returns no such copy
        is running. The indexes of the parts copied."""
        copies = self._arriving.pop(request_id, None)
        if copies is None:
            return set()
        with copies.lock:
            copies.sealed = True
            return copies.copied

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
            if left <= 0 or part.tier is None:
                break
            count = min(part.count, left)
            if index not in copied:
                event = self.copier.to_device(
                    self.store.view(part)[:count], planned.block_ids[offset : offset + count]
                )
            tokens = count * self.block_size
            self.counters.loaded_tokens_by_tier[part.tier] = self.counters.loaded_tokens_by_tier.get(part.tier, 0) + tokens
            self.counters.loaded_tokens += tokens
            offset += count
            left -= count
        seconds = time.perf_counter() - started
        self._after(event, lambda: self.store.close_load(load, seconds))
        self.counters.load_copy_seconds += seconds

    def save(self, plans: list[SavePlan]) -> int:
        """Copy records out of the device cache into slots; how many were taken (a record
        the store already holds, or for which no slot is free, is skipped; the store
        counts the latter)."""
        started = time.perf_counter()
        taken = 0
        for plan in plans:
            key = self.store.key(plan.block_hashes, plan.first_block)
            slot = self.store.reserve(key)
            if slot is None:
                continue
            copy_started = time.perf_counter()
            event = self.copier.from_device(plan.block_ids, self.store.payload(slot, key.num_blocks))
            seconds = time.perf_counter() - copy_started
            self._after(event, lambda slot=slot, key=key, seconds=seconds: self.store.commit(slot, key, seconds))
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
