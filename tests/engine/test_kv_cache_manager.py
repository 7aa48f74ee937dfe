"""Prefix lookup, allocation accounting and freeing order of the KV cache manager."""

from __future__ import annotations

from engine.hashing import BlockHasher
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

BS = 4
HASHER = BlockHasher(b"test-model", BS)


def make_request(request_id: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    request = Request(request_id, list(tokens), SamplingParams(), cache_salt=cache_salt)
    HASHER.extend(request.block_hashes, request.prompt_token_ids, cache_salt)
    return request


def admit(manager: KVCacheManager, request: Request) -> int:
    """Admit like the scheduler does, compute the whole prompt, cache it; the hit size."""
    hits, num_hit = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_hit, hits) is not None
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request, request.num_computed_tokens)
    return num_hit


def test_prefix_hit_never_covers_the_whole_prompt():
    manager = KVCacheManager(16, BS)
    tokens = list(range(2 * BS))
    first = make_request("a", tokens)
    admit(manager, first)
    manager.free(first)
    # Both blocks are cached, but the last token must be recomputed: one block hits.
    assert admit(manager, make_request("b", tokens)) == BS
    # One token more: both cached blocks hit, the new token is computed.
    assert admit(manager, make_request("c", [*tokens, 99])) == 2 * BS


def test_hit_is_the_longest_leading_run():
    manager = KVCacheManager(16, BS)
    first = make_request("a", list(range(3 * BS + 1)))
    admit(manager, first)
    manager.free(first)
    diverging = list(range(3 * BS + 1))
    diverging[BS + 1] = 1000  # second block differs, so the third's chained hash does too
    assert admit(manager, make_request("b", diverging)) == BS


def test_cache_salt_isolates():
    manager = KVCacheManager(16, BS)
    tokens = list(range(3 * BS))
    admit(manager, make_request("a", tokens, cache_salt="tenant-1"))
    assert admit(manager, make_request("b", tokens, cache_salt="tenant-2")) == 0
    assert admit(manager, make_request("c", tokens)) == 0
    assert admit(manager, make_request("d", tokens, cache_salt="tenant-1")) == 2 * BS


def test_free_is_tail_first_and_keeps_hashes():
    manager = KVCacheManager(4, BS)
    request = make_request("a", list(range(3 * BS + 1)))
    admit(manager, request)
    table = manager.get_block_ids("a")
    manager.free(request)
    queue = [b.block_id for b in manager.block_pool.free_queue.blocks()]
    assert queue[-4:] == table[::-1]
    assert sum(b.block_hash is not None for b in manager.block_pool.blocks) == 3
    assert manager.get_block_ids("a") == []


def test_decode_allocates_only_at_block_boundaries():
    manager = KVCacheManager(8, BS)
    request = make_request("a", list(range(BS)))
    assert len(manager.allocate_slots(request, BS, [])) == 1
    request.num_computed_tokens = BS
    assert len(manager.allocate_slots(request, 1)) == 1
    request.num_computed_tokens += 1
    assert manager.allocate_slots(request, 1) == []
    assert len(manager.get_block_ids("a")) == 2


def test_allocation_counts_revived_hit_blocks_against_the_free_queue():
    manager = KVCacheManager(4, BS)
    first = make_request("a", list(range(2 * BS + 1)))
    admit(manager, first)
    manager.free(first)  # two cached blocks and all four free
    other = make_request("x", [500] * BS)
    admit(manager, other)  # one block in use, three free of which two are cached
    second = make_request("b", list(range(2 * BS)) + [7] * (2 * BS))
    hits, num_hit = manager.get_computed_blocks(second)
    assert num_hit == 2 * BS
    # Needs 4 blocks: 2 revived hits + 2 new = 4 > 3 free.
    assert manager.allocate_slots(second, 2 * BS, hits) is None
    assert all(b.ref_cnt == 0 for b in hits)
    assert manager.get_block_ids("b") == []
    # Needs 3 blocks: 2 revived hits + 1 new = 3 free.
    assert len(manager.allocate_slots(second, BS, hits)) == 1
    assert all(b.ref_cnt == 1 for b in hits)
    assert manager.num_free_blocks == 0


def test_shared_hit_blocks_are_reference_counted():
    manager = KVCacheManager(8, BS)
    tokens = list(range(2 * BS + 1))
    a, b = make_request("a", tokens), make_request("b", tokens)
    admit(manager, a)
    admit(manager, b)
    shared = manager.get_blocks("a")[:2]
    assert manager.get_blocks("b")[:2] == shared
    assert [blk.ref_cnt for blk in shared] == [2, 2]
    manager.free(a)
    manager.free(b)
    assert all(blk.ref_cnt == 0 for blk in manager.block_pool.blocks)
    assert manager.num_free_blocks == 8


def test_prefix_stats_count_successful_admissions_in_tokens():
    manager = KVCacheManager(8, BS)
    tokens = list(range(2 * BS + 1))
    admit(manager, make_request("a", tokens))
    admit(manager, make_request("b", tokens))
    assert manager.prefix_cache_queries == 2 * len(tokens)
    assert manager.prefix_cache_hits == 2 * BS
    big = make_request("c", list(range(100, 100 + 8 * BS)))
    hits, _ = manager.get_computed_blocks(big)
    assert manager.allocate_slots(big, big.num_tokens, hits) is None
    assert manager.prefix_cache_queries == 2 * len(tokens)


def test_caching_disabled_never_hits():
    manager = KVCacheManager(8, BS, enable_caching=False)
    tokens = list(range(2 * BS + 1))
    admit(manager, make_request("a", tokens))
    assert admit(manager, make_request("b", tokens)) == 0
    assert manager.prefix_cache_queries == 0


def test_only_computed_blocks_are_cached():
    manager = KVCacheManager(8, BS)
    request = make_request("a", list(range(3 * BS)))
    manager.allocate_slots(request, 3 * BS, [])
    request.num_computed_tokens = BS + 1
    manager.cache_blocks(request, request.num_computed_tokens)
    hashed = [b.block_hash is not None for b in manager.get_blocks("a")]
    assert hashed == [True, False, False]


def test_held_cached_blocks_survive_allocations_until_released():
    """What a blend needs of the cache: look blocks up by hash, hold them outside any
    request while it allocates, release them after."""
    manager = KVCacheManager(4, BS)
    first = make_request("a", list(range(2 * BS + 1)))
    admit(manager, first)
    manager.free(first)
    held = manager.hit_blocks(first.block_hashes)
    assert [b.block_id for b in held] == [manager.cached_block(h).block_id for h in first.block_hashes[:2]]
    manager.hold(held)
    other = make_request("b", [100 + t for t in range(2 * BS)])
    assert manager.allocate_slots(other, 2 * BS, []) is not None  # takes the two free blocks
    assert manager.allocate_slots(make_request("c", [200]), 1, []) is None  # the held ones are not free
    assert manager.hit_blocks(first.block_hashes) == held
    manager.release(held)
    assert manager.allocate_slots(make_request("d", [300] * BS), BS, []) is not None  # evicts one now
    assert len(manager.hit_blocks(first.block_hashes)) < 2
