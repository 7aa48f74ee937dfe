"""Eviction policies (tiers/eviction.py): LRU order, ARC's lists, ghosts and adaptation,
pins respected by both, and ARC through the cpu and disk tiers."""

from __future__ import annotations

import pytest

from tiers import CpuTier, PinTable, TierConfigError
from tiers.cpu import NO_ROOM
from tiers.disk import DiskTier
from tiers.eviction import EVICTION_POLICIES, ArcPolicy, EvictionPolicy, LruPolicy, make_policy

SLOT = 256


class Cache:
    """A cache of `size` keys over a policy, as a tier uses it: a hit touches, a miss
    evicts the first candidate when full, then adds."""

    def __init__(self, policy: EvictionPolicy, size: int, pinned: frozenset[str] = frozenset()) -> None:
        self.policy, self.size, self.pinned = policy, size, pinned
        self.hits = 0

    def access(self, key: str) -> None:
        if self.policy.get(key) is not None:
            self.hits += 1
            return
        if len(self.policy) >= self.size:
            victim = next(self.policy.candidates(lambda k, _: k not in self.pinned), None)
            if victim is None:
                return  # no room: not stored
            self.policy.evict(victim)
        self.policy.add(key, 1)


def test_make_policy_knows_the_names():
    assert isinstance(make_policy("lru"), LruPolicy) and isinstance(make_policy("arc"), ArcPolicy)
    assert EVICTION_POLICIES == ("lru", "arc")
    with pytest.raises(TierConfigError, match="'lfu' is not one of lru, arc"):
        make_policy("lfu")


def test_lru_evicts_the_least_recently_used():
    cache = Cache(LruPolicy(), 3)
    for key in "abc":
        cache.access(key)
    cache.access("a")
    cache.access("d")
    assert sorted(cache.policy) == ["a", "c", "d"]


def test_a_scan_flushes_lru_but_not_arcs_frequent_list():
    hot = ["h1", "h2", "h3"]
    scan = [f"once{i}" for i in range(40)]
    caches = {name: Cache(make_policy(name), 6) for name in EVICTION_POLICIES}
    for cache in caches.values():
        for _ in range(2):
            for key in hot:
                cache.access(key)
        for key in scan:
            cache.access(key)
    assert not set(hot) & set(caches["lru"].policy)
    arc = caches["arc"].policy
    assert set(hot) <= set(arc) and arc.frequent_keys == hot
    assert len(arc) == 6  # the scan cycled through the recency list alone


def test_a_second_hit_moves_a_key_to_the_frequent_list():
    arc = ArcPolicy()
    arc.add("a", 1)
    assert arc.recent_keys == ["a"] and arc.get("a", touch=False) == 1 and arc.recent_keys == ["a"]
    assert arc.get("a") == 1
    assert arc.recent_keys == [] and arc.frequent_keys == ["a"]


def test_a_recency_ghost_hit_grows_the_recency_target():
    arc = ArcPolicy()
    cache = Cache(arc, 4)
    for key in "abcd":
        cache.access(key)
    cache.access("e")  # evicts a (T1) into the recency ghosts
    assert arc.is_ghost("a") and "a" not in arc and arc.target_recent == 0
    cache.access("a")  # a ghost hit: T1 was too short
    assert arc.target_recent == 1
    assert "a" in arc.frequent_keys and not arc.is_ghost("a")


def test_a_frequency_ghost_hit_shrinks_the_recency_target():
    arc = ArcPolicy()
    cache = Cache(arc, 2)
    for key in "ab":
        cache.access(key)
        cache.access(key)  # both frequent
    cache.access("c")  # T1 is empty: evicts from T2, a becomes a frequency ghost
    assert arc.is_ghost("a")
    cache.access("d")  # evicts c from T1 (T1 at its target): a recency ghost
    cache.access("c")  # recency ghost hit: target 1
    assert arc.target_recent == 1
    cache.access("a")  # frequency ghost hit: back down
    assert arc.target_recent == 0
    assert "a" in arc.frequent_keys


def test_ghost_lists_are_bounded_by_the_cache_size():
    arc = ArcPolicy()
    cache = Cache(arc, 5)
    for index in range(100):
        cache.access(f"k{index}")
    ghosts = sum(arc.is_ghost(f"k{index}") for index in range(100))
    assert len(arc) == 5 and ghosts == 5


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_pinned_keys_are_never_candidates(name):
    cache = Cache(make_policy(name), 3, pinned=frozenset({"a", "b"}))
    for key in ("a", "b", "a", "b", "c", "d", "e"):
        cache.access(key)
    assert {"a", "b"} <= set(cache.policy) and "e" in cache.policy
    all_pinned = make_policy(name)
    all_pinned.add("a", 1)
    assert next(all_pinned.candidates(lambda key, _: False), None) is None


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_pop_forgets_a_key_without_a_ghost(name):
    policy = make_policy(name)
    policy.add("a", 1)
    assert policy.pop("a") == 1 and "a" not in policy and len(policy) == 0
    assert policy.pop("a") is None
    if isinstance(policy, ArcPolicy):
        assert not policy.is_ghost("a")


# ---- through the tiers ----------------------------------------------------------------------


def put(tier: CpuTier, name: str) -> bool:
    slot = tier.reserve(name)
    if slot < 0:
        return slot != NO_ROOM
    tier.commit(slot)
    tier.release(slot)
    return True


def load(tier: CpuTier, name: str) -> bool:
    slot = tier.acquire(name)
    if slot is not None:
        tier.release(slot)
    return slot is not None


def test_cpu_tier_with_arc_keeps_hot_records_through_a_scan_and_respects_pins():
    pins = PinTable()
    tier = CpuTier(4 * SLOT, SLOT, pins, pin_memory=False, eviction="arc")
    pins.pin(["pinned"])
    put(tier, "pinned")
    for name in ("hot1", "hot2"):
        put(tier, name)
        load(tier, name)
    for index in range(20):
        put(tier, f"once{index}")
    assert all(tier.has(name) for name in ("pinned", "hot1", "hot2"))
    assert tier.has("once19") and tier.counters["evictions"] == 19


def test_write_behind_copies_are_not_hits():
    tier = CpuTier(2 * SLOT, SLOT, pin_memory=False, eviction="arc")
    put(tier, "a")
    slot = tier.acquire("a", hit=False)
    tier.release(slot)
    put(tier, "b")
    put(tier, "c")  # a was never hit: the first evicted
    assert not tier.has("a") and tier.has("b")


def test_disk_tier_with_arc_keeps_hot_records_through_a_scan(tmp_path):
    record = b"x" * 1000
    tier = DiskTier(tmp_path, 4 * len(record), eviction="arc")
    for name in ("hot1", "hot2"):
        assert tier.put([(name, record)]) == [True]
        assert tier.get([name])[0] is not None
    for index in range(10):
        assert tier.put([(f"once{index}", record)]) == [True]
    assert tier.holds("hot1") and tier.holds("hot2") and tier.holds("once9")
    assert tier.entries == 4 and tier.usage_bytes == 4 * len(record)


@pytest.mark.parametrize("name", EVICTION_POLICIES)
def test_disk_tier_rewriting_a_recently_evicted_record_is_a_ghost_hit_for_arc(tmp_path, name):
    """A record written again soon after its eviction goes to ARC's frequency list, where
    the one-off records written after it do not reach it; LRU evicts it with them."""
    record = b"x" * 1000
    tier = DiskTier(tmp_path, 3 * len(record), eviction=name)
    for key in ("back", "a", "b", "c"):  # c evicts back: a recency ghost
        assert tier.put([(key, record)]) == [True]
    assert not tier.holds("back")
    assert tier.put([("back", record)]) == [True]
    for index in range(4):
        assert tier.put([(f"once{index}", record)]) == [True]
    assert tier.holds("back") == (name == "arc")
