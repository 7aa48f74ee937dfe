"""Host slots and the cpu tier: LRU under its byte budget, pins, references, deletion,
and slots that keep nothing without the tier."""

from __future__ import annotations

import mmap
import sys

import pytest
import torch

from tests.store.store_helpers import resident_fraction
from tiers import CpuTier, PinTable, TierConfigError, cpu
from tiers.cpu import ALREADY_PRESENT, NO_ROOM, SLOT_ALIGN

SLOT = 256


def make_tier(slots: int, pins: PinTable | None = None, retain: bool = True) -> CpuTier:
    return CpuTier(slots * SLOT, SLOT, pins, pin_memory=False, retain=retain)


def put(tier: CpuTier, name: str, value: int) -> bool:
    """Store `name` with every byte `value`; True if the tier holds it afterwards."""
    slot = tier.reserve(name)
    if slot == ALREADY_PRESENT:
        return True
    if slot == NO_ROOM:
        return False
    tier.buffer(slot)[:] = bytes([value]) * SLOT
    tier.commit(slot)
    tier.release(slot)
    return True


def read(tier: CpuTier, name: str) -> int | None:
    slot = tier.acquire(name)
    if slot is None:
        return None
    try:
        return tier.buffer(slot)[0]
    finally:
        tier.release(slot)


def test_capacity_is_whole_aligned_slots():
    tier = CpuTier(3 * SLOT + 10, SLOT - 5, pin_memory=False)
    assert tier.slot_bytes == SLOT and tier.slot_bytes % SLOT_ALIGN == 0
    assert tier.num_slots == 3 and tier.capacity_bytes == 3 * SLOT
    with pytest.raises(TierConfigError):
        CpuTier(10, SLOT, pin_memory=False)


def test_put_get_roundtrip_and_usage():
    tier = make_tier(2)
    assert put(tier, "a", 7) and read(tier, "a") == 7
    assert read(tier, "missing") is None
    assert tier.usage_bytes == SLOT and tier.entries == 1
    assert put(tier, "a", 9) and read(tier, "a") == 7  # already present: kept, not rewritten
    assert tier.slots_in_use == 0


def test_lru_keeps_the_most_recently_used_and_reports_evictions():
    tier = make_tier(3)
    for index, name in enumerate("abc"):
        put(tier, name, index)
    read(tier, "a")  # a is now the newest
    put(tier, "d", 4)
    put(tier, "e", 5)
    assert [k for k in "abcde" if tier.has(k)] == ["a", "d", "e"]
    assert tier.counters["evictions"] == 2 and tier.take_removed() == ["b", "c"]
    assert tier.take_removed() == []


def test_pinned_records_are_never_evicted():
    pins = PinTable()
    tier = make_tier(2, pins)
    pins.pin(["a"])
    put(tier, "a", 1)
    for i in range(10):
        put(tier, f"k{i}", i)
    assert tier.has("a") and tier.has("k9")
    pins.pin(["k9"])
    assert not put(tier, "x", 0)  # every slot pinned: rejected, not evicted
    assert tier.counters["put_rejected"] == 1


def test_pin_ttl_expires():
    now = [0.0]
    pins = PinTable(clock=lambda: now[0])
    tier = make_tier(1, pins)
    pins.pin(["a"], ttl_s=10)
    put(tier, "a", 1)
    assert not put(tier, "b", 2)
    now[0] = 11.0
    assert put(tier, "b", 2) and not tier.has("a")


def test_held_and_reserved_slots_are_not_evicted():
    tier = make_tier(2)
    put(tier, "a", 1)
    slot = tier.acquire("a")
    reserved = tier.reserve("b")
    assert reserved >= 0 and tier.reserve("b") == ALREADY_PRESENT
    assert tier.reserve("c") == NO_ROOM
    tier.commit(reserved)
    tier.release(reserved)
    tier.release(slot)
    assert tier.reserve("c") >= 0  # now "a" (LRU, unheld) can go
    assert not tier.has("a")


def test_an_aborted_reservation_publishes_nothing():
    tier = make_tier(1)
    slot = tier.reserve("a")
    tier.abort(slot)
    assert not tier.has("a") and tier.slots_in_use == 0 and tier.reserve("b") >= 0


def test_delete_while_held_frees_on_release():
    tier = make_tier(1)
    put(tier, "a", 3)
    slot = tier.acquire("a")
    assert tier.delete(["a"]) == 1
    assert not tier.has("a") and tier.take_removed() == ["a"]
    assert tier.reserve("b") == NO_ROOM  # the reader still holds the slot
    assert tier.buffer(slot)[0] == 3
    tier.release(slot)
    assert put(tier, "b", 4)


def test_without_the_tier_a_committed_slot_lives_as_long_as_someone_holds_it():
    slots = make_tier(1, retain=False)
    slot = slots.reserve("a")
    slots.commit(slot)
    assert slots.acquire("a") == slot and not slots.has("a")  # visible, not kept
    slots.release(slot)
    assert slots.reserve("b") == NO_ROOM  # held still by its reserver
    slots.release(slot)
    assert slots.acquire("a") is None and slots.reserve("b") >= 0
    assert slots.capacity_bytes == 0 and slots.usage_bytes == 0


def test_clear_by_prefix_spares_pins():
    pins = PinTable()
    tier = make_tier(4, pins)
    for name in ("m1-a", "m1-b", "m2-a"):
        put(tier, name, 1)
    pins.pin(["m1-b"])
    assert tier.clear("m1-") == 1
    assert [tier.has(k) for k in ("m1-a", "m1-b", "m2-a")] == [False, True, True]


def slab_resident_fraction(tier: CpuTier, start: int, end: int) -> float:
    """Of the whole pages inside slab bytes [start, end), the fraction in memory."""
    return resident_fraction(tier.slab.data_ptr() + start, end - start)


@pytest.mark.skipif(sys.platform != "linux", reason="pages are populated ahead on Linux only")
def test_fresh_slots_have_their_pages_populated_ahead_of_use_and_keep_their_bytes(monkeypatch):
    mib = 1 << 20
    monkeypatch.setattr(cpu, "POPULATE_AHEAD_BYTES", 8 * mib)
    monkeypatch.setattr(cpu, "POPULATE_PIECE_BYTES", 2 * mib)
    # A fresh anonymous mapping: malloc may serve even 64 MiB from pages it kept.
    mapping = mmap.mmap(-1, 64 * mib)
    monkeypatch.setattr(cpu, "allocate_host", lambda nbytes, pin: (torch.frombuffer(mapping, dtype=torch.uint8), "plain"))
    tier = CpuTier(64 * mib, mib, pin_memory=False)
    (name, populate), = tier.upkeep()
    assert name == "cpu-populate" and tier.populated_bytes == 0
    assert slab_resident_fraction(tier, 0, 64 * mib) == 0

    def until_idle() -> float | None:
        """Run the step while it has more to do at once; its answer when it has not."""
        while (delay := populate()) == 0.0:
            pass
        return delay

    assert until_idle() == cpu.POPULATE_POLL_S and tier.populated_bytes == 8 * mib
    tier.buffer(20)[:4] = b"kept"  # a slot past the frontier written before its turn
    for n in range(20):
        assert tier.reserve(f"r{n}") == n
    # as far as the slots in use plus the lead, and no further
    assert until_idle() == cpu.POPULATE_POLL_S and tier.populated_bytes == 28 * mib
    assert slab_resident_fraction(tier, 0, 28 * mib) == 1
    assert slab_resident_fraction(tier, 32 * mib, 64 * mib) == 0  # past a huge page's reach
    assert bytes(tier.buffer(20)[:4]) == b"kept"


@pytest.mark.skipif(sys.platform != "linux", reason="pages are populated ahead on Linux only")
def test_make_resident_faults_in_the_whole_slab_keeps_its_bytes_and_stops_the_populator(monkeypatch):
    mib = 1 << 20
    mapping = mmap.mmap(-1, 16 * mib)  # fresh: no page of it resident yet
    monkeypatch.setattr(cpu, "allocate_host", lambda nbytes, pin: (torch.frombuffer(mapping, dtype=torch.uint8), "plain"))
    tier = CpuTier(16 * mib, mib, pin_memory=False)
    assert tier.reserve("r0") == 0
    tier.buffer(0)[:4] = b"kept"
    assert slab_resident_fraction(tier, 0, 16 * mib) < 0.1
    tier.make_resident()
    assert slab_resident_fraction(tier, 0, 16 * mib) == 1
    assert tier.populated_bytes == 16 * mib and bytes(tier.buffer(0)[:4]) == b"kept"
    assert tier.upkeep()[0][1]() is None  # nothing left to populate


def test_make_resident_without_madvise_leaves_the_slab_to_the_populator(monkeypatch):
    def refuse(tensor):
        raise cpu.PagePopulateError(22, "madvise(MADV_POPULATE_WRITE) failed: errno 22")

    monkeypatch.setattr(cpu, "populate_pages", refuse)
    tier = make_tier(8)
    tier.make_resident()
    assert tier.populated_bytes == 0  # the populator still has every slot ahead of it


def test_make_resident_leaves_a_slab_larger_than_the_available_memory_to_the_populator(monkeypatch, caplog):
    tier = make_tier(64)
    monkeypatch.setattr(cpu, "available_memory", lambda: 16 * SLOT)
    tier.make_resident()
    assert tier.populated_bytes == 0
    assert "more than the" in caplog.text and "memory available" in caplog.text


def test_available_memory_reads_meminfo():
    available = cpu.available_memory()
    assert sys.platform != "linux" or 0 < available < 1 << 50


def test_a_slab_touched_at_start_leaves_the_populator_nothing_to_do():
    tier = make_tier(4)
    tier.touch_pages(4 * SLOT)
    assert tier.populated_bytes == 4 * SLOT
    assert tier.upkeep()[0][1]() is None  # nothing left to do
