"""Device KV blocks, the O(1) LRU free queue and the hash -> block prefix-cache map.

A block is in exactly one of three states:
- in use: ref_cnt > 0, not in the free queue (its hash, if any, stays in the map);
- cached and free: ref_cnt == 0, in the free queue, still in the map (a prefix hit revives it);
- free: ref_cnt == 0, in the free queue, no hash.
The free queue is the eviction order: `get_new_blocks` takes from its head and drops the
hash of a cached block it takes; freed blocks go to its tail.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(eq=False)
class KVBlock:
    """One device KV block. `prev`/`next` are the intrusive links of the free queue."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None
    prev: KVBlock | None = field(default=None, repr=False)
    next: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks threaded through the blocks themselves.

    Unlike a deque, removing a block from the middle (a prefix-cache hit on a free cached
    block) is O(1). Two sentinels remove every edge case from the link updates."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVBlock:
        block = self._head.next
        if block is self._tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev is None or block.next is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev is not None or block.next is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev
        last.next = block
        block.prev = last
        block.next = self._tail
        self._tail.prev = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            self.append(block)

    def blocks(self) -> list[KVBlock]:
        """The free blocks in eviction order (head first); O(n), for tests and debugging."""
        out = []
        block = self._head.next
        while block is not self._tail:
            out.append(block)
            block = block.next
        return out


TokenRange = Callable[[int, int], list[int]]  # a sequence's tokens [start, end)


class PrefixCacheListener(Protocol):
    """Told when blocks enter and leave the prefix cache (the KV events of engine/kv_events)."""

    def stored(self, block_hashes: Sequence[bytes], parent: bytes | None, first_block: int,
               token_ids_between: TokenRange) -> None: ...

    def removed(self, block_hashes: Sequence[bytes]) -> None: ...


class BlockPool:
    """All device KV blocks, their reference counts and the prefix-cache map.

    The map holds at most one block per hash: when two requests compute the same block
    concurrently, the second copy stays uncached and is simply reused once freed."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVBlock] = {}
        self.listener: PrefixCacheListener | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out, cached-but-free ones included."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue (ref_cnt 1 each),
        evicting the least recently freed cached blocks."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} are free")
        out = []
        evicted = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        if evicted and self.listener is not None:
            self.listener.removed(evicted)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on prefix-hit blocks, reviving free cached ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching 0 join the free queue in the
        given order, so the first one given is evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more often than taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self, blocks: Sequence[KVBlock], block_hashes: Sequence[bytes], start: int, end: int,
        token_ids_between: TokenRange | None = None,
    ) -> None:
        """Register blocks[start:end], whose KV is computed, under block_hashes[start:end]
        (`token_ids_between`: the sequence's tokens, for the listener)."""
        if not self.enable_caching:
            return
        run_start = None  # of the blocks cached by this call in a row, for the listener
        for index in range(start, end):
            block, block_hash = blocks[index], block_hashes[index]
            if block.block_hash is None and block_hash not in self.cached:
                block.block_hash = block_hash
                self.cached[block_hash] = block
                run_start = index if run_start is None else run_start
            elif run_start is not None:
                self._announce(block_hashes, run_start, index, token_ids_between)
                run_start = None
        if run_start is not None:
            self._announce(block_hashes, run_start, end, token_ids_between)

    def _announce(self, block_hashes: Sequence[bytes], start: int, end: int, tokens: TokenRange | None) -> None:
        if self.listener is not None and tokens is not None:
            parent = block_hashes[start - 1] if start else None
            self.listener.stored(block_hashes[start:end], parent, start, tokens)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        if self.cached and self.listener is not None:
            self.listener.removed(list(self.cached))
        self.cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
