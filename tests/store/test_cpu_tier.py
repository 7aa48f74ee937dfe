"""CPU slab tier: LRU under its byte budget, pins, references, deletion."""

from __future__ import annotations

import asyncio

import pytest
import torch

from tests.store.store_helpers import bits_equal
from tiers import CpuTier, PinTable, TierConfigError
from tiers.cpu import ALREADY_PRESENT, NO_ROOM

SHAPE = (4, 8)


def chunk(value: float) -> torch.Tensor:
    return torch.full(SHAPE, value, dtype=torch.bfloat16)


def make_tier(slots: int, pins: PinTable | None = None) -> CpuTier:
    return CpuTier(slots * 4 * 8 * 2, SHAPE, torch.bfloat16, pins)


def test_capacity_is_whole_slots():
    tier = CpuTier(3 * 64 + 10, SHAPE, torch.bfloat16)
    assert tier.num_slots == 3 and tier.capacity_bytes == 192
    with pytest.raises(TierConfigError):
        CpuTier(10, SHAPE, torch.bfloat16)


def test_put_get_roundtrip_and_usage():
    tier = make_tier(2)
    assert tier.put_from("a", chunk(1.5))
    out = torch.empty(SHAPE, dtype=torch.bfloat16)
    assert tier.get_into("a", out) and bits_equal(out, chunk(1.5))
    assert not tier.get_into("missing", out)
    assert tier.usage_bytes == 64 and tier.entries == 1
    assert tier.put_from("a", chunk(9.0))  # already present: kept, not rewritten
    assert tier.get_into("a", out) and bits_equal(out, chunk(1.5))


def test_lru_keeps_the_most_recently_used():
    tier = make_tier(3)
    for name in "abc":
        tier.put_from(name, chunk(1))
    tier.get_into("a", torch.empty(SHAPE, dtype=torch.bfloat16))  # a is now the newest
    tier.put_from("d", chunk(4))
    tier.put_from("e", chunk(5))
    assert [k for k in "abcde" if tier.has_local(k)] == ["a", "d", "e"]
    assert tier.counters["evictions"] == 2
    assert tier.usage_bytes <= tier.capacity_bytes


def test_pinned_chunks_are_never_evicted():
    pins = PinTable()
    tier = make_tier(2, pins)
    pins.pin(["a"])
    tier.put_from("a", chunk(1))
    for i in range(10):
        tier.put_from(f"k{i}", chunk(i))
    assert tier.has_local("a") and tier.has_local("k9")
    pins.pin(["k9"])
    assert not tier.put_from("x", chunk(0))  # every slot pinned: rejected, not evicted
    assert tier.counters["put_rejected"] == 1


def test_pin_ttl_expires():
    now = [0.0]
    pins = PinTable(clock=lambda: now[0])
    tier = make_tier(1, pins)
    pins.pin(["a"], ttl_s=10)
    tier.put_from("a", chunk(1))
    assert not tier.put_from("b", chunk(2))
    now[0] = 11.0
    assert tier.put_from("b", chunk(2)) and not tier.has_local("a")


def test_referenced_and_reserved_slots_are_not_evicted():
    tier = make_tier(2)
    tier.put_from("a", chunk(1))
    slot = tier.acquire("a")
    reserved = tier.reserve("b")
    assert reserved >= 0 and tier.reserve("b") == ALREADY_PRESENT
    assert tier.reserve("c") == NO_ROOM
    tier.commit(reserved)
    tier.release(slot)
    assert tier.reserve("c") >= 0  # now "a" (LRU, unreferenced) can go
    assert not tier.has_local("a")


def test_delete_while_referenced_frees_on_release():
    tier = make_tier(1)
    tier.put_from("a", chunk(3))
    slot = tier.acquire("a")
    assert asyncio.run(tier.delete(["a"])) == 1
    assert not tier.has_local("a")
    assert tier.reserve("b") == NO_ROOM  # the reader still holds the slot
    assert bits_equal(tier.view(slot), chunk(3))
    tier.release(slot)
    assert tier.put_from("b", chunk(4))


def test_clear_by_prefix_spares_pins():
    pins = PinTable()
    tier = make_tier(4, pins)
    for name in ("m1-a", "m1-b", "m2-a"):
        tier.put_from(name, chunk(1))
    pins.pin(["m1-b"])
    assert asyncio.run(tier.clear("m1-")) == 1
    assert [tier.has_local(k) for k in ("m1-a", "m1-b", "m2-a")] == [False, True, True]
