"""Free queue links and LRU order, reference counts, caching and eviction of the block pool."""

from __future__ import annotations

import pytest

from engine.block_pool import BlockPool, FreeBlockQueue, KVBlock


def ids(blocks: list[KVBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def test_free_queue_popleft_append_remove_keep_order():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert len(queue) == 5
    queue.remove(blocks[2])
    assert ids(queue.blocks()) == [0, 1, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.append(blocks[2])
    queue.append_n([blocks[0]])
    assert ids(queue.blocks()) == [1, 3, 4, 2, 0]
    assert len(queue) == 5
    queue.remove(blocks[0])  # the tail
    queue.remove(blocks[1])  # the head
    assert ids(queue.blocks()) == [3, 4, 2]
    assert blocks[0].prev is None and blocks[0].next is None


def test_free_queue_rejects_misuse():
    block = KVBlock(0)
    queue = FreeBlockQueue([block])
    with pytest.raises(ValueError):
        queue.append(block)
    queue.popleft()
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(block)


def test_remove_from_middle_touches_only_neighbours():
    blocks = [KVBlock(i) for i in range(100_000)]
    queue = FreeBlockQueue(blocks)
    for block in blocks[1::2]:
        queue.remove(block)
    assert len(queue) == 50_000
    assert blocks[0].next is blocks[2] and blocks[2].prev is blocks[0]


def test_new_blocks_come_from_the_head_with_one_reference():
    pool = BlockPool(4)
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)


def test_freed_blocks_join_the_tail_in_the_given_order():
    pool = BlockPool(4)
    a, b, c, _ = pool.get_new_blocks(4)
    pool.free_blocks([c, a, b])
    assert ids(pool.free_queue.blocks()) == [2, 0, 1]
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def test_shared_block_is_free_only_after_the_last_reference():
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert pool.num_free_blocks == 1
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2


def test_touch_revives_a_cached_free_block():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"h0", b"h1"], 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.get_cached_block(b"h0") is blocks[0]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert ids(pool.free_queue.blocks()) == [2, 1]


def test_eviction_takes_the_lru_block_and_drops_its_hash():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first, second], [b"a", b"b"], 0, 2)
    pool.free_blocks([second, first])
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is second
    assert evicted.block_hash is None
    assert pool.get_cached_block(b"b") is None
    assert pool.get_cached_block(b"a") is first


def test_a_hash_maps_to_one_block_and_duplicates_stay_uncached():
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(2)
    pool.cache_full_blocks([first], [b"same"], 0, 1)
    pool.cache_full_blocks([second], [b"same"], 0, 1)
    assert pool.get_cached_block(b"same") is first
    assert second.block_hash is None


def test_caching_disabled_caches_nothing():
    pool = BlockPool(1, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"h"], 0, 1)
    assert pool.get_cached_block(b"h") is None


def test_reset_prefix_cache_only_when_nothing_is_in_use():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"x", b"y"], 0, 2)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"x") is None
    assert all(b.block_hash is None for b in blocks)
