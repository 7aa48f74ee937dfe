"""Per-request block tables on top of the block pool: prefix lookup, allocation, freeing.

Where block hashes come from: `request.block_hashes` is extended by the scheduler with
`engine.hashing.BlockHasher` (prompt blocks in `Scheduler.add_request`, output blocks in
`Scheduler.update_from_output`). This module only reads them.

When blocks enter the prefix cache: only once their KV is written, i.e. after the model
step that computed them (`cache_blocks`, called from `Scheduler.update_from_output`). A
block is therefore never found by a prefix lookup before its KV exists, whatever order
the model runner writes KV in, and a failed step leaves nothing half-written in the cache.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.block_pool import BlockPool, KVBlock
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached blocks matching the request's leading block hashes.

        The hit is capped at `num_tokens - 1` rounded down to whole blocks: the last
        token is always recomputed, because its forward pass yields the logits to sample
        from. This is a pure lookup; the query is counted when the admission succeeds.
        A request that must compute its prompt itself (`skip_reading_prefix_cache`:
        prompt logprobs) hits nothing."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = self.hit_blocks(request.block_hashes[:max_blocks])
        return hits, len(hits) * self.block_size

    def cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block of the prefix cache that holds `block_hash`'s KV, if any."""
        return self.block_pool.get_cached_block(block_hash)

    def hit_blocks(self, block_hashes: Sequence[bytes]) -> list[KVBlock]:
        """The leading run of `block_hashes` that the prefix cache holds."""
        hits: list[KVBlock] = []
        for block_hash in block_hashes:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def hold(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks outside any request (a blend reading them),
        so that no allocation evicts them until `release`."""
        self.block_pool.touch(blocks)

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """Drop the references `hold` took."""
        self.block_pool.free_blocks(blocks)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVBlock] | None = None,
        num_external_computed_tokens: int = 0,
    ) -> list[KVBlock] | None:
        """Give the request room for its computed tokens plus `num_new_tokens` more.

        On admission pass `new_computed_blocks` (the prefix hit, possibly empty) and
        `num_external_computed_tokens` (tokens a connector will load into the new
        blocks); the request's `num_computed_tokens` must not include them yet. A
        successful admission counts one prefix-cache query of `request.num_tokens`,
        unless the request does not read the cache (`skip_reading_prefix_cache`, as vLLM:
        its misses would say nothing about the cache).
        Returns the newly allocated blocks, or None (and changes nothing) when the free
        queue cannot supply them; hit blocks revived from the free queue count against it."""
        hits = new_computed_blocks or []
        table = self.req_to_blocks.get(request.request_id, [])
        num_tokens = (
            request.num_computed_tokens + len(hits) * self.block_size
            + num_external_computed_tokens + num_new_tokens
        )
        num_needed = max(cdiv(num_tokens, self.block_size) - len(table) - len(hits), 0)
        num_revived = sum(1 for block in hits if block.ref_cnt == 0)
        if num_needed + num_revived > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(num_needed)
        table = self.req_to_blocks.setdefault(request.request_id, table)
        table.extend(hits)
        table.extend(new_blocks)
        if new_computed_blocks is not None and self.enable_caching and not request.skip_reading_prefix_cache:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(hits) * self.block_size
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Put the request's full blocks whose KV is computed into the prefix cache."""
        if not self.enable_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        table = self.req_to_blocks[request.request_id]
        self.block_pool.cache_full_blocks(table, request.block_hashes, start, num_full, request.token_ids_between)
        self.num_cached_blocks[request.request_id] = num_full

    def share_blocks(self, request: Request, blocks: list[KVBlock]) -> None:
        """Start a request that holds no blocks with a reference on `blocks` (computed,
        full blocks of another request with the same tokens): parallel sampling's fork."""
        if request.request_id in self.req_to_blocks:
            raise ValueError(f"request {request.request_id!r} already holds blocks")
        self.block_pool.touch(blocks)
        self.req_to_blocks[request.request_id] = list(blocks)
        self.num_cached_blocks[request.request_id] = len(blocks) if self.enable_caching else 0

    def free(self, request: Request) -> None:
        """Release the request's blocks tail first, so its prefix stays cached longest."""
        table = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    def get_blocks(self, request_id: str) -> list[KVBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.get_blocks(request_id)]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
