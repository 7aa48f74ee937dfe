"""Transfers: what moves a record's bytes between the host slots and the record tiers.

The worker side of vLLM's offload split (its OffloadingWorker and transfer handlers);
which slots a transfer uses is the manager's decision (kvstore.manager). The connector's
worker (connectors/worker.py) calls these on the engine thread, and they return at once:

- a load: `open_load` takes the manager's plan for a run of blocks and hands the reads
  of the records the host slots lack to the read pool (kvstore.loading), which reads
  them into their reserved slots and verifies them there; `view` is a part's blocks in
  its slot; `close_load` gives the load back to the manager (promotion, releases);
- a prefetch: reads of a run's records into the host slots, settled by the manager's
  `poll`;
- a save: `reserve` a slot (the manager's `prepare_save`), copy the blocks into its
  `payload`, `commit` it: visible in the host slots at once, written to the record
  tiers by the write-behind's pool (kvstore.saving).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from kvstore.index import BlockLocation, StoredRecord
from kvstore.keys import ChunkKey
from kvstore.loading import Destination, Loader, ReadBatch
from kvstore.manager import LoadPart, StoreManager
from kvstore.parts import StoreParts
from kvstore.saving import WriteBehind
from kvstore.spec import ChunkSpec


@dataclass(eq=False)
class Load:
    """Records opened for one load, in block order; done when every read is settled (at
    once when the host slots kept them all). `blocked`: the load stops short at a record
    that another load or a prefetch is reading into the host slots, so opening it again
    once that read is settled covers more."""

    parts: list[LoadPart]
    batch: ReadBatch | None  # the reads of its parts the host slots lacked
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
        slot or missed (None for a part the host slots kept, or before the load starts).
        A worker may copy the part out from a callback of its own on it."""
        read = self.parts[index].read
        return None if read is None or self.batch is None else self.batch.part_of(read)

    def offer(self, index: int, destination: Destination) -> None:
        """Before the load starts: part `index` may be read straight into `destination`
        (kvstore.loading) rather than into its slot."""
        read = self.parts[index].read
        if read is not None:
            read.destination = destination

    def part_tier(self, index: int) -> str | None:
        """`LoadPart.tier` of part `index`: where its blocks came from, None while they
        have not (or will not) arrive."""
        return self.parts[index].tier

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


class Transfers:
    def __init__(self, spec: ChunkSpec, parts: StoreParts, manager: StoreManager, loader: Loader,
                 writer: WriteBehind) -> None:
        self.spec = spec
        self.manager = manager
        self.host = parts.host
        # The host slots' memory as one row of bytes per slot, and the layout of the
        # blocks in a slot's payload, read once: a view is made per part of every load.
        self._slots = parts.host.slab.view(parts.host.num_slots, parts.host.slot_bytes)
        self._payload_offset = parts.codec.payload_offset
        self._block_bytes = spec.block_bytes
        self._block_shape = spec.block_shape
        self._dtype = spec.dtype
        self._loader = loader
        self._writer = writer
        self._load_timeout = manager.config.kv_load_timeout
        self.key = manager.key  # the key a save reserves a slot for

    @property
    def keeps_loaded_records(self) -> bool:
        """The manager's `keeps_loaded_records`: without promotion, a load may have its
        records read straight to where their blocks go (`Load.offer`)."""
        return self.manager.keeps_loaded_records

    # loads -------------------------------------------------------------------------------

    def open_load(self, run: Sequence[BlockLocation], timeout_s: float | None = None, start: bool = True) -> Load:
        """Open the records holding `run` (from the manager's `locate`): a record the
        host slots keep is held as it is, the others are read into reserved slots. The
        load covers the leading part of `run` that got a slot. Give it back with
        `close_load`. With `start` False its reads wait for `Load.start` (it is not done
        before)."""
        plan = self.manager.prepare_load(run)
        if not plan.reads:
            return Load(plan.parts, None, plan.blocked)
        batch = self._loader.batch(plan.reads, timeout_s or self._load_timeout)
        load = Load(plan.parts, batch, plan.blocked, lambda: self._loader.start(batch))
        if start:
            load.start()
        return load

    def view(self, part: LoadPart) -> torch.Tensor:
        """The part's blocks in its slot, `[count, *block shape]` (valid until closed)."""
        return self._blocks(part.slot, part.position, part.count)

    def close_load(self, load: Load, copy_seconds: float | None = None) -> None:
        """Give back a load that is done (the manager's `complete_load`: promotion of
        what was read, slots released). `copy_seconds`: how long copying its cpu-tier
        blocks out took (get latency)."""
        self.manager.complete_load(load, copy_seconds)

    def prefetch(self, records: Sequence[StoredRecord]) -> ReadBatch | None:
        """Read these records into the host slots in the background; the batch is done
        when they are in (None: nothing to read, or host slots that keep nothing)."""
        reads = self.manager.prepare_prefetch(records)
        if not reads:
            return None
        batch = self._loader.batch(reads, self._load_timeout)
        self._loader.start(batch)
        self.manager.track_prefetch(batch)
        return batch

    def prefetch_run(self, run: Sequence[BlockLocation]) -> ReadBatch | None:
        """`prefetch` of the records holding a run of blocks (from `locate`)."""
        return self.prefetch(list({id(loc.record): loc.record for loc in run}.values()))

    # saves -------------------------------------------------------------------------------

    def reserve(self, key: ChunkKey) -> int | None:
        """A host slot to copy the record of `key` into (its payload: `payload`), or None
        when the record is there already or no slot is free (counted)."""
        return self.manager.prepare_save(key)

    def payload(self, slot: int, num_blocks: int) -> torch.Tensor:
        """The first `num_blocks` blocks of a slot's payload, `[num_blocks, *block shape]`."""
        return self._blocks(slot, 0, num_blocks)

    def commit(self, slot: int, key: ChunkKey, copy_seconds: float | None = None) -> Future[frozenset[str]]:
        """The record of `key` is complete in `slot`: the host slots hold it now (kept
        when they are the cpu tier), the write-behind writes it to the record tiers that
        lack it; the future gives every tier holding it then. The caller's reference on
        the slot is released. `copy_seconds`: how long copying it into the slot took
        (put latency)."""
        self.host.commit(slot)
        if copy_seconds is not None and self.host.retain:
            self.host.counters.observe_put(copy_seconds)
        targets, stored = self.manager.complete_save(key)
        future = self._writer.submit(key, slot, targets, stored)
        self.host.release(slot)
        return future

    @property
    def all_tiers(self) -> frozenset[str]:
        """Every tier a save is written to."""
        return self._writer.all_tiers

    def _blocks(self, slot: int, position: int, count: int) -> torch.Tensor:
        start = self._payload_offset + position * self._block_bytes
        raw = self._slots[slot, start : start + count * self._block_bytes]
        return raw.view(self._dtype).view(count, *self._block_shape)
