"""Reproducible block hashes and the model fingerprint.

Block hash chain: h_i = SHA-256(h_{i-1} || tokens_i as little-endian uint32 || extra_i),
with h_{-1} = SHA-256(b"kvtier-block-seed/v1" || fingerprint). Nothing here depends on
Python's hash(), pickle or PYTHONHASHSEED, so two processes (or machines) agree.
`extra` of the first block carries the request's cache_salt, so tenants never share:
b"salt" || len(salt as UTF-8) as little-endian uint32 || salt as UTF-8 (empty without one).
The fingerprint is SHA-256 of the ModelFingerprint fields as compact JSON, keys sorted.

Every stored key derives from these bytes, so they are a format shared by every process
of a store: tests/engine/test_hash_vectors.py pins them with literal vectors. Changing
them is a version bump (the seed's "/v1", LAYOUT_VERSION): see docs/ARCHITECTURE.md.
"""

from __future__ import annotations

import hashlib
import json
import struct
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass

# 2: the fingerprint gained config_digest and tokenizer_digest (records of version 1
# named KV of another config alike; they are found under no key of version 2)
LAYOUT_VERSION = 2
HASH_BYTES = 32


@dataclass(frozen=True)
class ModelFingerprint:
    """What makes KV bytes of two engines interchangeable: a store shared by several
    instances (disk directory, Redis) serves one instance's KV to another only when every
    field agrees, so each input that changes the KV or what its keys mean is here.

    `config_digest` is `ModelArgs.digest` (rope theta and scaling, norm epsilon, head
    layout: checkpoints with the same weights and another config compute other KV);
    `tokenizer_digest` is `engine.models.tokenizer_digest` (keys made from text);
    `kv_dtype`, `block_size` and `layout_version` fix the bytes of a record.
    """

    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str
    block_size: int
    weights_digest: str
    config_digest: str
    tokenizer_digest: str
    layout_version: int = LAYOUT_VERSION

    @property
    def digest(self) -> bytes:
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).digest()

    @property
    def hex(self) -> str:
        return self.digest.hex()


def seed_hash(fingerprint: bytes) -> bytes:
    return hashlib.sha256(b"kvtier-block-seed/v1" + fingerprint).digest()


def salt_extra(cache_salt: str | None) -> bytes:
    """Extra key bytes of a request's first block (empty when there is no salt)."""
    if not cache_salt:
        return b""
    salt = cache_salt.encode()
    return b"salt" + struct.pack("<I", len(salt)) + salt


if array("I").itemsize != 4:
    raise ImportError("array('I') is not 32-bit on this platform; block hashes need uint32 tokens")
_BIG_ENDIAN = struct.pack("=I", 1) != struct.pack("<I", 1)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    """Tokens as little-endian uint32, as the block hash chain takes them."""
    try:
        packed = array("I", tokens)
    except OverflowError:
        raise ValueError("token ids must be in [0, 2**32) to be hashed") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _chain(parent: bytes, packed: bytes | memoryview, extra: bytes) -> bytes:
    """One link of the block hash chain, from a block's packed tokens."""
    return hashlib.sha256(parent + packed + extra).digest()


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    return _chain(parent, _token_bytes(tokens), extra)


class BlockHasher:
    """Extends a request's list of full-block hashes as its tokens grow."""

    def __init__(self, fingerprint: bytes, block_size: int) -> None:
        self.seed = seed_hash(fingerprint)
        self.block_size = block_size

    def extend(self, hashes: list[bytes], token_ids: Sequence[int], cache_salt: str | None) -> None:
        """Append the hashes of every newly full block of `token_ids` to `hashes`. The
        new blocks' tokens are packed once, then hashed block by block from that buffer
        (a long prompt's chain is one pass, not one packing per block)."""
        bs = self.block_size
        first = len(hashes) * bs
        full = (len(token_ids) - first) // bs * bs
        if full <= 0:
            return
        packed = memoryview(_token_bytes(token_ids[first : first + full]))
        parent = hashes[-1] if hashes else self.seed
        extra = salt_extra(cache_salt) if first == 0 else b""  # the sequence's first block only
        step = bs * 4
        for offset in range(0, full * 4, step):
            parent = _chain(parent, packed[offset : offset + step], extra)
            hashes.append(parent)
            extra = b""

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        out: list[bytes] = []
        self.extend(out, token_ids, cache_salt)
        return out
