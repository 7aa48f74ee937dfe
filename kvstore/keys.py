"""Chunk keys: the content address of one chunk of one model and layout.

A chunk of `chunk_tokens` tokens is named by the chained hash of the block that ends
it (engine.hashing), which already covers every token before it. The tier key also
carries the model fingerprint and the chunk size, so two models (or two chunk sizes of
one model) sharing a disk directory or a Redis never collide:

    <fingerprint hex>-<chunk_tokens>-<block hash hex>

The record header repeats fingerprint and block hash, so a record copied under another
key is rejected on read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import StoreConfigError

BLOCK_HASH_BYTES = 32


@dataclass(frozen=True, slots=True)
class ChunkKey:
    block_hash: bytes
    name: str


class ChunkKeyer:
    """Makes the ChunkKeys of one store (one fingerprint, one chunk size)."""

    def __init__(self, fingerprint: bytes, chunk_tokens: int) -> None:
        self.namespace = f"{fingerprint.hex()}-{chunk_tokens}-"

    def key(self, block_hash: bytes) -> ChunkKey:
        if len(block_hash) != BLOCK_HASH_BYTES:
            raise StoreConfigError(
                f"block hashes are {BLOCK_HASH_BYTES} bytes, got {len(block_hash)}"
            )
        return ChunkKey(block_hash, self.namespace + block_hash.hex())

    def chunk_keys(self, block_hashes: Sequence[bytes], blocks_per_chunk: int) -> list[ChunkKey]:
        """Keys of every complete chunk of a request, given all its full-block hashes."""
        ends = range(blocks_per_chunk - 1, len(block_hashes), blocks_per_chunk)
        return [self.key(block_hashes[i]) for i in ends]
