"""Host memory of the store: one slab of fixed-size record slots; with `retain` (the
cpu tier) the committed slots are kept within the byte budget, in the order of their
eviction policy (tiers.eviction: lru or arc).

The slab is allocated once (pinned when CUDA exists, so device copies can be
asynchronous; cupy's pinned allocator when installed, because torch's caching host
allocator rounds a request up to a power of two); a plain slab hands out fresh slots in
order and has their pages faulted in ahead of use by the store's maintenance thread
(`cpu-populate`), so
that no save pays page faults in the engine's step; `make_resident` faults in the whole
slab at once (a server does at start, as pinning would). A slot holds one record in wire
layout (kvstore.record: header, payload, room for the MAC); the store decides the
layout, this module only hands out slots and counts references.

Slot life cycle: `reserve(name)` (the reserver holds a reference; the slot is not
visible) -> `commit` (visible to `acquire`, kept by the eviction policy when retaining) ->
`release` by every holder. A slot is freed when nobody holds it and it is not retained
(never committed, aborted, evicted, removed, or committed without `retain`). A held,
reserved or pinned slot is never evicted. Every method takes one short lock and does no
I/O; `take_removed` reports the names the tier no longer holds (evicted or removed).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tiers.base import ALREADY_PRESENT, NO_ROOM, Tier, Upkeep
from tiers.errors import TierConfigError
from tiers.eviction import EvictionPolicy, make_policy
from tiers.pins import PinTable

log = logging.getLogger(__name__)

SLOT_ALIGN = 64
PAGE_BYTES = 4096
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in writable without writing them
POPULATE_AHEAD_BYTES = 512 << 20  # populated past the highest slot handed out so far
POPULATE_PIECE_BYTES = 32 << 20  # one madvise call of the background populator
POPULATE_POLL_S = 0.05


class PagePopulateError(OSError):
    """The kernel cannot populate pages ahead of use (madvise refused it)."""


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc


def available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none): what the
    kernel can hand out without swapping."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def populate_pages(tensor: torch.Tensor) -> None:
    """Fault in the pages of `tensor`'s memory, writable, without writing them: their
    contents are kept, so this is safe while other threads write there, and so is the
    part of a page outside the tensor (it belongs to the same mapping)."""
    if sys.platform != "linux":
        raise PagePopulateError("populating pages ahead needs Linux")
    if tensor.numel() == 0:
        return
    start = tensor.data_ptr() // PAGE_BYTES * PAGE_BYTES
    end = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE_BYTES) * PAGE_BYTES
    if _libc().madvise(start, end - start, MADV_POPULATE_WRITE) != 0:
        errno = ctypes.get_errno()
        raise PagePopulateError(errno, f"madvise(MADV_POPULATE_WRITE) failed: errno {errno}")


def allocate_host(nbytes: int, pin: bool | None = None) -> tuple[torch.Tensor, str]:
    """A uint8 host tensor of `nbytes` and how it was allocated ("cupy", "torch", "plain").
    Pinned by default when CUDA exists."""
    if pin is None:
        pin = torch.cuda.is_available()
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8), "plain"
    try:
        import cupy
    except ImportError:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "torch"
    return _cupy_pinned(cupy, nbytes), "cupy"


def _cupy_pinned(cupy: Any, nbytes: int) -> torch.Tensor:
    import numpy as np

    memory = cupy.cuda.alloc_pinned_memory(nbytes)
    # numpy keeps `memory` alive through the array's base, torch through the array.
    return torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=nbytes))


class CpuTier(Tier):
    name = "cpu"

    def __init__(
        self,
        capacity_bytes: int,
        slot_bytes: int,
        pins: PinTable | None = None,
        pin_memory: bool | None = None,
        retain: bool = True,
        eviction: str = "lru",
    ) -> None:
        super().__init__(pins)
        self.slot_bytes = -(-slot_bytes // SLOT_ALIGN) * SLOT_ALIGN
        self.num_slots = capacity_bytes // self.slot_bytes
        if self.num_slots < 1:
            raise TierConfigError(
                f"cpu tier of {capacity_bytes} bytes cannot hold one {slot_bytes}-byte record"
            )
        self.retain = retain
        self.eviction = eviction
        try:
            self.slab, self.allocation = allocate_host(self.num_slots * self.slot_bytes, pin_memory)
        except (RuntimeError, MemoryError) as exc:  # torch reports ENOMEM as a RuntimeError
            raise TierConfigError(
                f"cannot allocate {self.num_slots * self.slot_bytes} bytes of host memory for the cpu tier"
            ) from exc
        self._rows = self.slab.numpy().reshape(self.num_slots, self.slot_bytes)
        self._buffers: list[memoryview | None] = [None] * self.num_slots
        self._lock = threading.Lock()
        self._index: EvictionPolicy[int] = make_policy(eviction)  # committed and retained: name -> slot
        self._visible: dict[str, int] = {}  # committed, not retained, still held
        self._reserved: dict[str, int] = {}
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._refs = [0] * self.num_slots
        self._slot_name: list[str | None] = [None] * self.num_slots
        self._removed: list[str] = []
        self._high_water = 0  # slots [0, high water) have been handed out
        self._populated = 0  # slots [0, populated) have their pages faulted in

    def touch_pages(self, nbytes: int) -> None:
        """Write the pages of the slots handed out first (up to `nbytes`) now: a first
        touch on the data path costs a page fault per 4 KiB inside the step, many times
        the copy itself. The slots after them are populated ahead of use on the store's
        upkeep thread (`cpu-populate`)."""
        self.slab[: min(nbytes, self.slab.numel())].zero_()
        self._populated = max(self._populated, min(self.num_slots, nbytes // self.slot_bytes))

    def make_resident(self) -> None:
        """Fault in every page of the slab now, before traffic. Pages first touched while
        the engine runs cost the kernel's zeroing, and on a VM the host's fault as well,
        on the cores the forward needs, however far ahead the populator works; paid at
        start, they cost nothing later, because evicted slots are reused in place. Without
        MADV_POPULATE_WRITE the slab stays populated ahead of use."""
        if self.allocation != "plain" or self._populated == self.num_slots:
            return
        wanted, available = (self.num_slots - self._populated) * self.slot_bytes, available_memory()
        if available is not None and wanted > available:
            log.warning("cpu tier: %.1f GiB is more than the %.1f GiB of memory available now; its pages are "
                        "faulted in as it fills", wanted / 2**30, available / 2**30)
            return
        try:
            populate_pages(self.slab[self._populated * self.slot_bytes :])
        except PagePopulateError as exc:
            log.info("cpu tier: pages are populated ahead of use, not at start (%s)", exc)
            return
        self._populated = self.num_slots

    @property
    def populated_bytes(self) -> int:
        """The leading bytes of the slab whose pages are faulted in (touched or populated)."""
        return self._populated * self.slot_bytes

    # ---- Tier -----------------------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes if self.retain else 0

    @property
    def usage_bytes(self) -> int:
        return len(self._index) * self.slot_bytes

    @property
    def entries(self) -> int:
        return len(self._index)

    @property
    def slots_in_use(self) -> int:
        """Slots held by someone (reserved, being read or written); 0 when idle."""
        with self._lock:
            return sum(1 for refs in self._refs if refs)

    def has(self, name: str) -> bool:
        with self._lock:
            return name in self._index

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [self.has(key) for key in keys]

    def delete(self, keys: Sequence[str]) -> int:
        return self.remove(keys)

    def clear(self, prefix: str = "") -> int:
        with self._lock:
            keys = [key for key in self._index if key.startswith(prefix)]
        return self.remove(keys, only_unpinned=True)

    def take_removed(self) -> list[str]:
        with self._lock:
            removed, self._removed = self._removed, []
        return removed

    def upkeep(self) -> Sequence[Upkeep]:
        """Pinned memory is resident from the start; a plain slab is populated ahead."""
        return (("cpu-populate", self.populate_ahead),) if self.allocation == "plain" else ()

    def populate_ahead(self) -> float | None:
        """Fault in the pages of the next never-used slots, one piece per call, keeping
        POPULATE_AHEAD_BYTES ahead of the highest slot handed out, off the engine thread:
        a save into a fresh slot otherwise pays a page fault per 4 KiB inside the step.
        The seconds until the next call; None once the whole slab is populated (or the
        kernel cannot populate ahead)."""
        if self._populated >= self.num_slots:
            return None
        ahead = max(1, POPULATE_AHEAD_BYTES // self.slot_bytes)
        piece = max(1, POPULATE_PIECE_BYTES // self.slot_bytes)
        wanted = min(self.num_slots, self._high_water + ahead)
        if wanted <= self._populated:
            return POPULATE_POLL_S
        start, end = self._populated, min(wanted, self._populated + piece)
        try:
            populate_pages(self.slab[start * self.slot_bytes : end * self.slot_bytes])
        except PagePopulateError as exc:
            log.info("cpu tier: slots are not populated ahead of use (%s)", exc)
            return None
        self._populated = max(self._populated, end)  # make_resident may have gone further
        return 0.0 if self._populated < self.num_slots else None

    # ---- slots ----------------------------------------------------------------------------

    def buffer(self, slot: int) -> memoryview:
        """The slot as a writable flat byte buffer."""
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = self._buffers[slot] = memoryview(self._rows[slot])
        return buffer

    def reserve(self, name: str) -> int:
        """A free slot for writing `name`, evicting the policy's first unheld, unpinned
        record if needed. ALREADY_PRESENT if `name` is committed or being
        written, NO_ROOM if every slot is held, reserved or pinned."""
        with self._lock:
            if name in self._index or name in self._reserved or name in self._visible:
                return ALREADY_PRESENT
            slot = self._free.pop() if self._free else self._evict_one_locked()
            if slot is None:
                self.counters.add(put_rejected=1)
                return NO_ROOM
            self._high_water = max(self._high_water, slot + 1)
            self._reserved[name] = slot
            self._slot_name[slot] = name
            self._refs[slot] = 1
            return slot

    def commit(self, slot: int) -> None:
        """Make a reserved slot visible; the reserver still holds it until `release`."""
        with self._lock:
            name = self._slot_name[slot]
            del self._reserved[name]
            if self.retain:
                self._index.add(name, slot)
            else:
                self._visible[name] = slot
        if self.retain:
            self.counters.add(puts=1, bytes_written=self.slot_bytes)

    def abort(self, slot: int) -> None:
        """Give a reserved slot back without publishing it (the reserver's reference)."""
        with self._lock:
            self._reserved.pop(self._slot_name[slot], None)
            self._slot_name[slot] = None
            self._unref_locked(slot)

    def acquire(self, name: str, hit: bool = True) -> int | None:
        """Hold `name`'s committed slot (it is not evicted until `release`). A `hit` (a
        load, not the write-behind copying the record down) counts for the eviction policy."""
        with self._lock:
            slot = self._index.get(name, touch=hit)
            if slot is None:
                slot = self._visible.get(name)
            if slot is not None:
                self._refs[slot] += 1
            return slot

    def hold(self, slot: int) -> None:
        """Take one more reference on a slot the caller already holds."""
        with self._lock:
            self._refs[slot] += 1

    def release(self, slot: int) -> None:
        with self._lock:
            self._unref_locked(slot)

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
                self._forget_locked(slot)
                self._removed.append(key)
        self.counters.add(deletes=removed)
        return removed

    def _unref_locked(self, slot: int) -> None:
        self._refs[slot] -= 1
        if self._refs[slot]:
            return
        name = self._slot_name[slot]
        if name is not None and self._visible.get(name) == slot:
            del self._visible[name]
            self._slot_name[slot] = None
        if self._slot_name[slot] is None:
            self._free.append(slot)

    def _forget_locked(self, slot: int) -> None:
        """A retained slot leaves the index; it is freed now or by its last release."""
        self._slot_name[slot] = None
        if self._refs[slot] == 0:
            self._free.append(slot)

    def _evict_one_locked(self) -> int | None:
        victim = next(self._index.candidates(
            lambda key, slot: self._refs[slot] == 0 and not self.pins.is_pinned(key)
        ), None)
        if victim is None:
            return None
        slot = self._index.evict(victim)
        self._slot_name[slot] = None
        self._removed.append(victim)
        self.counters.add(evictions=1)
        return slot
