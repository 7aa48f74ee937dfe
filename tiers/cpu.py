"""CPU memory tier: a preallocated slab of fixed-size chunk slots.

The slab is one tensor `[num_slots, *slot_shape]` allocated at construction (pinned when
CUDA exists, so device copies can be asynchronous). A slot's tensor view and byte view
are made on its first use and kept, so once the tier is warm, storing or fetching a
chunk allocates nothing: it is one locked index update and one memcpy outside the lock.

Slot life cycle: `reserve` (writer holds it) -> `commit` (visible, in LRU order) ->
evicted or deleted. Readers `acquire`/`release` a reference; a referenced, reserved or
pinned slot is never evicted, and a deleted slot that still has readers is freed by the
last `release`.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence

import torch

from tiers.base import Tier
from tiers.errors import TierConfigError
from tiers.lru import LruIndex
from tiers.pins import PinTable

ALREADY_PRESENT = -1
NO_ROOM = -2


class CpuTier(Tier):
    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        slot_shape: Sequence[int],
        dtype: torch.dtype,
        pins: PinTable | None = None,
        pin_memory: bool | None = None,
    ) -> None:
        super().__init__(pins)
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.slot_bytes = math.prod(slot_shape) * itemsize
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise TierConfigError(
                f"cpu tier of {capacity_bytes} bytes cannot hold one {self.slot_bytes}-byte chunk"
            )
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        self._slab = torch.empty((self.num_slots, *slot_shape), dtype=dtype, pin_memory=pin_memory)
        self._rows = self._slab.view(torch.uint8).reshape(self.num_slots, self.slot_bytes).numpy()
        self._views: list[torch.Tensor | None] = [None] * self.num_slots
        self._buffers: list[memoryview | None] = [None] * self.num_slots
        self._lock = threading.Lock()
        self._index: LruIndex[int] = LruIndex()
        self._pending: dict[str, int] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._refs = [0] * self.num_slots
        self._slot_key: list[str | None] = [None] * self.num_slots

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    @property
    def usage_bytes(self) -> int:
        return (self.num_slots - len(self._free)) * self.slot_bytes

    @property
    def entries(self) -> int:
        return len(self._index)

    def has_local(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [self.has_local(key) for key in keys]

    def view(self, slot: int) -> torch.Tensor:
        """The slot as a tensor of the chunk's shape and dtype."""
        view = self._views[slot]
        if view is None:
            view = self._views[slot] = self._slab[slot]
        return view

    def buffer(self, slot: int) -> memoryview:
        """The slot as a writable flat byte buffer."""
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = self._buffers[slot] = memoryview(self._rows[slot])
        return buffer

    def reserve(self, key: str) -> int:
        """A slot for writing `key`, evicting the LRU unpinned chunk if needed.

        Returns ALREADY_PRESENT if the key is stored or being written, NO_ROOM if every
        slot is pinned, referenced or reserved."""
        with self._lock:
            if key in self._index or key in self._pending:
                return ALREADY_PRESENT
            slot = self._free.pop() if self._free else self._evict_one_locked()
            if slot is None:
                self.counters.add(put_rejected=1)
                return NO_ROOM
            self._pending[key] = slot
            self._slot_key[slot] = key
            self._refs[slot] = 1
            return slot

    def commit(self, slot: int) -> None:
        """Make a reserved slot visible to readers."""
        with self._lock:
            key = self._slot_key[slot]
            del self._pending[key]
            self._index.add(key, slot)
            self._refs[slot] -= 1
        self.counters.add(puts=1, bytes_written=self.slot_bytes)

    def abort(self, slot: int) -> None:
        """Give back a reserved slot without publishing it."""
        with self._lock:
            self._pending.pop(self._slot_key[slot], None)
            self._slot_key[slot] = None
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                self._free.append(slot)

    def acquire(self, key: str) -> int | None:
        """Take a reference on `key`'s slot (it cannot be evicted until `release`)."""
        with self._lock:
            slot = self._index.get(key)
            if slot is not None:
                self._refs[slot] += 1
            return slot

    def release(self, slot: int) -> None:
        with self._lock:
            self._refs[slot] -= 1
            if self._refs[slot] == 0 and self._slot_key[slot] is None:
                self._free.append(slot)

    def put_from(self, key: str, src: torch.Tensor) -> bool:
        """Copy `src` (chunk shape and dtype) in; True if the tier holds `key` afterwards."""
        slot = self.reserve(key)
        if slot == ALREADY_PRESENT:
            return True
        if slot == NO_ROOM:
            return False
        start = time.perf_counter()
        try:
            self.view(slot).copy_(src)
        except BaseException:
            self.abort(slot)
            raise
        self.commit(slot)
        self.counters.observe_put(time.perf_counter() - start)
        return True

    def get_into(self, key: str, out: torch.Tensor) -> bool:
        """Copy `key`'s chunk into `out`; False if absent."""
        slot = self.acquire(key)
        if slot is None:
            return False
        start = time.perf_counter()
        try:
            out.copy_(self.view(slot))
        finally:
            self.release(slot)
        self.counters.add(bytes_read=self.slot_bytes)
        self.counters.observe_get(time.perf_counter() - start)
        return True

    def remove(self, keys: Sequence[str], only_unpinned: bool = False) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                if only_unpinned and self.pins.is_pinned(key):
                    continue
                slot = self._index.pop(key)
                if slot is None:
                    continue
                removed += 1
                self._slot_key[slot] = None
                if self._refs[slot] == 0:
                    self._free.append(slot)
        self.counters.add(deletes=removed)
        return removed

    async def delete(self, keys: Sequence[str]) -> int:
        return self.remove(keys)

    async def clear(self, prefix: str = "") -> int:
        with self._lock:
            keys = [key for key in self._index if key.startswith(prefix)]
        return self.remove(keys, only_unpinned=True)

    def _evict_one_locked(self) -> int | None:
        victim = self._index.victim(
            lambda key, slot: self._refs[slot] == 0 and not self.pins.is_pinned(key)
        )
        if victim is None:
            return None
        slot = self._index.pop(victim)
        self._slot_key[slot] = None
        self.counters.add(evictions=1)
        return slot
