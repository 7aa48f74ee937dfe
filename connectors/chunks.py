"""Chunk geometry and the plain records of one step's loads and saves.

Chunk i of a request covers tokens [i*C, (i+1)*C) and blocks [i*B, (i+1)*B) of its block
table (C = chunk_tokens, B = C / block_size). Its key is the chained hash of its last
block, so a chunk exists only once all its tokens are known.

A request whose loadable tokens end inside a chunk also has a short "tail" chunk: the
full blocks from the last chunk boundary up to that end, keyed by the hash of its last
block. Its record keeps the chunk shape (the blocks past the tail are zeros). Because a
block hash names the whole prefix before it and the tail starts at a chunk boundary, a
key always names the same blocks: a chunk-boundary block ends a full chunk, any other
block ends a tail. Without tails, a replayed prompt would recompute up to C - 1 tokens
that the store could have supplied.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from connectors.transfer import HostChunk
from kvstore import ChunkKey, LoadResult


@dataclass(frozen=True)
class ChunkGeometry:
    block_size: int
    chunk_tokens: int

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def num_full_chunks(self, block_hashes: Sequence[bytes]) -> int:
        return len(block_hashes) // self.blocks_per_chunk

    def end_hash(self, block_hashes: Sequence[bytes], chunk: int) -> bytes:
        return block_hashes[(chunk + 1) * self.blocks_per_chunk - 1]

    def chunk_blocks(self, block_ids: Sequence[int], chunk: int) -> tuple[int, ...]:
        first = chunk * self.blocks_per_chunk
        return tuple(block_ids[first : first + self.blocks_per_chunk])

    def tail_blocks(self, end_block: int) -> range | None:
        """Blocks of the tail chunk that ends before block `end_block`, None when
        `end_block` is a chunk boundary (a full chunk ends there, or nothing does)."""
        start = end_block // self.blocks_per_chunk * self.blocks_per_chunk
        return range(start, end_block) if start < end_block else None

    def tail_end(self, num_tokens: int) -> int | None:
        """The end block of the tail chunk that can supply tokens of a request of
        `num_tokens` tokens: its loadable end, when that lies inside a chunk the request
        does not fill."""
        end = self.loadable_end(num_tokens) // self.block_size
        full_chunks = num_tokens // self.block_size // self.blocks_per_chunk
        if end % self.blocks_per_chunk == 0 or full_chunks > end // self.blocks_per_chunk:
            return None
        return end

    def loadable_end(self, num_tokens: int) -> int:
        """Tokens [0, end) may come from a store: whole blocks, never the last token
        (its forward pass yields the logits to sample from)."""
        return (num_tokens - 1) // self.block_size * self.block_size


@dataclass(eq=False)
class LoadJob:
    """Loading tokens [start_token, end_token) of one request, chunk by chunk from
    `first_chunk`, into host staging and then into the request's device blocks.

    `chunks[j]` receives chunk `first_chunk + j`; `block_ids` are the destination blocks
    of tokens [start_token, end_token), known once the request is allocated. The device
    hit may end inside the first chunk: that chunk is loaded whole and only its
    missing blocks are written."""

    request_id: str
    first_chunk: int
    start_token: int
    end_token: int
    chunks: list[HostChunk]
    future: Future[LoadResult]
    is_async: bool
    block_ids: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.end_token - self.start_token

    def loaded_end(self, result: LoadResult, geometry: ChunkGeometry) -> int:
        """End of the tokens that really arrived: only the leading run of chunks counts."""
        run_end = (self.first_chunk + result.num_leading_ok) * geometry.chunk_tokens
        return max(self.start_token, min(self.end_token, run_end))

    def scatter_plan(self, end_token: int, geometry: ChunkGeometry) -> list[tuple[int, slice, list[int]]]:
        """(job chunk index, its blocks to write, destination block ids) for tokens
        [start_token, end_token)."""
        bs, per_chunk = geometry.block_size, geometry.blocks_per_chunk
        start_block, end_block = self.start_token // bs, end_token // bs
        plan = []
        for j in range(len(self.chunks)):
            base = (self.first_chunk + j) * per_chunk
            lo, hi = max(base, start_block), min(base + per_chunk, end_block)
            if lo < hi:
                dst = self.block_ids[lo - start_block : hi - start_block]
                plan.append((j, slice(lo - base, hi - base), dst))
        return plan

    def tier_runs(self, result: LoadResult, end_token: int, geometry: ChunkGeometry) -> list[tuple[str, int]]:
        """(tier, tokens) of [start_token, end_token) in token order: consecutive tokens
        one tier delivered make one run."""
        runs: list[tuple[str, int]] = []
        for j, tier in enumerate(result.tiers):
            lo = max(self.start_token, (self.first_chunk + j) * geometry.chunk_tokens)
            hi = min(end_token, (self.first_chunk + j + 1) * geometry.chunk_tokens)
            if tier is None or lo >= hi:
                continue
            if runs and runs[-1][0] == tier:
                runs[-1] = (tier, runs[-1][1] + hi - lo)
            else:
                runs.append((tier, hi - lo))
        return runs

    def tokens_by_tier(self, result: LoadResult, end_token: int, geometry: ChunkGeometry) -> dict[str, int]:
        """Tokens of [start_token, end_token) each tier delivered."""
        out: dict[str, int] = {}
        for tier, tokens in self.tier_runs(result, end_token, geometry):
            out[tier] = out.get(tier, 0) + tokens
        return out


@dataclass(frozen=True)
class ChunkSave:
    key: ChunkKey
    block_ids: tuple[int, ...]


@dataclass
class StepMeta:
    """The worker-side work of one step: synchronous loads to write into the device
    cache before the forward, chunks to copy out after it."""

    loads: list[LoadJob] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
