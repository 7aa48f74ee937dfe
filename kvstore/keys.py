"""Record keys: the content address of one record of one model and layout.

A record holds the blocks `[first_block, first_block + n)` of a sequence, where
`first_block` is a multiple of `blocks_per_chunk` and `n <= blocks_per_chunk`. It is
named by the chained hash of its last block (engine.hashing), which already covers every
token before it, so the name fixes its tokens, first block and length. The tier key also
carries the model fingerprint, the chunk size and the record format version, so two
models, two chunk sizes or two format versions sharing a directory or a Redis never see
each other's records:

    <fingerprint hex>-<chunk_tokens>-v<format version>-<last block hash hex>

The same namespace plus a block's hash names that block in a tier's block index (Redis
keeps it under its own key prefix). The record header repeats fingerprint, first block
and every block hash, so a record copied under another key is rejected on read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import StoreConfigError
from kvstore.record import FORMAT_VERSION

BLOCK_HASH_BYTES = 32


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """The key of one record: its tier name, first block and the hash of every block."""

    name: str
    first_block: int
    block_hashes: tuple[bytes, ...]

    @property
    def block_hash(self) -> bytes:
        """The hash of the record's last block (the one its name carries)."""
        return self.block_hashes[-1]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)


class ChunkKeyer:
    """Makes the keys of one store (one fingerprint, chunk size and format version)."""

    def __init__(self, fingerprint: bytes, chunk_tokens: int, blocks_per_chunk: int) -> None:
        self.namespace = f"{fingerprint.hex()}-{chunk_tokens}-v{FORMAT_VERSION}-"
        self.blocks_per_chunk = blocks_per_chunk

    def name(self, block_hash: bytes) -> str:
        """The tier name of the record ending with this block (and of the block itself
        in a tier's block index)."""
        if len(block_hash) != BLOCK_HASH_BYTES:
            raise StoreConfigError(
                f"block hashes are {BLOCK_HASH_BYTES} bytes, got {len(block_hash)}"
            )
        return self.namespace + block_hash.hex()

    def key(self, block_hashes: Sequence[bytes], first_block: int = 0) -> ChunkKey:
        """The key of the record holding blocks with these hashes from `first_block` on."""
        hashes = tuple(block_hashes)
        if not 1 <= len(hashes) <= self.blocks_per_chunk:
            raise StoreConfigError(
                f"a record holds 1 to {self.blocks_per_chunk} blocks, got {len(hashes)}"
            )
        if first_block < 0 or first_block % self.blocks_per_chunk:
            raise StoreConfigError(
                f"records start at a chunk boundary (a multiple of {self.blocks_per_chunk} "
                f"blocks), got block {first_block}"
            )
        for block_hash in hashes[:-1]:
            if len(block_hash) != BLOCK_HASH_BYTES:
                raise StoreConfigError(f"block hashes are {BLOCK_HASH_BYTES} bytes")
        return ChunkKey(self.name(hashes[-1]), first_block, hashes)

    def record_key(self, sequence_hashes: Sequence[bytes], first_block: int, end_block: int) -> ChunkKey:
        """The key of a sequence's record from `first_block` (a chunk boundary) to `end_block`."""
        return self.key(sequence_hashes[first_block:end_block], first_block)

    def chunk_keys(self, sequence_hashes: Sequence[bytes]) -> list[ChunkKey]:
        """Keys of every full record of a sequence, given all its full-block hashes."""
        per = self.blocks_per_chunk
        return [
            self.record_key(sequence_hashes, start, start + per)
            for start in range(0, len(sequence_hashes) - per + 1, per)
        ]
