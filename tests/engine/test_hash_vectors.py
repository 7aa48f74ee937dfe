"""Literal vectors of the block-hash formula: the bytes every process sharing a store
must agree on (a change here is a format change; docs/ARCHITECTURE.md, "Keys").

The literals were computed once with hashlib from the formula as documented in
engine/hashing.py and DESIGN.md, not with engine.hashing; `documented_*` below is that
derivation, kept so that a reader can redo it."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest

from engine.hashing import BlockHasher, ModelFingerprint, hash_block, salt_extra, seed_hash

FINGERPRINT = ModelFingerprint(
    architecture="LlamaForCausalLM", num_layers=30, num_kv_heads=3, head_dim=64,
    kv_dtype="bfloat16", block_size=16, weights_digest="0" * 64, config_digest="1" * 64,
    tokenizer_digest="2" * 64,
)
FINGERPRINT_HEX = "bf515f7c54b787fbba0553d470d8464c9fb7b9bc48451496271ad253a0308591"
SEED_HEX = "be9cdd269a2e93e69a5b6a0ba5b22069bd183d300f64e316e06ebea360dedcf8"
TOKENS = [0, 1, 2**31, 2**32 - 1, 49151, 7, 8, 9, 10]  # two full blocks of 4, one token left
UNSALTED_HEX = [
    "bd8453244d9e6cdbe64704d3d1c3f45f75eed2232f282e4023c4a45a6c846d11",
    "cf868138964bc24c4b2099d548a7eaf79cca9bc5c76cf30f69be92c0bf33daef",
]
SALT = "tenant-a"
SALTED_HEX = [
    "015322606c26de76a39ff059570031300921e2fd80a06d14b6549e12c23d4d72",
    "ef27e07c0ad2a77d43855656828dc5d32058134ed3490300b24648710c3b07ce",
]


def documented_fingerprint(fields: dict) -> bytes:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).digest()


def documented_chain(seed: bytes, tokens: list[int], block_size: int, salt: str | None) -> list[bytes]:
    hashes, parent = [], seed
    for start in range(0, len(tokens) - block_size + 1, block_size):
        data = parent + b"".join(struct.pack("<I", t) for t in tokens[start : start + block_size])
        if start == 0 and salt:
            data += b"salt" + struct.pack("<I", len(salt.encode())) + salt.encode()
        parent = hashlib.sha256(data).digest()
        hashes.append(parent)
    return hashes


def test_the_fingerprint_and_seed_are_the_documented_bytes():
    assert FINGERPRINT.hex == FINGERPRINT_HEX
    assert seed_hash(FINGERPRINT.digest).hex() == SEED_HEX
    fields = {"architecture": "LlamaForCausalLM", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64,
              "kv_dtype": "bfloat16", "block_size": 16, "weights_digest": "0" * 64,
              "config_digest": "1" * 64, "tokenizer_digest": "2" * 64, "layout_version": 2}
    assert documented_fingerprint(fields).hex() == FINGERPRINT_HEX
    assert hashlib.sha256(b"kvtier-block-seed/v1" + bytes.fromhex(FINGERPRINT_HEX)).hexdigest() == SEED_HEX


@pytest.mark.parametrize(("salt", "expected"), [(None, UNSALTED_HEX), (SALT, SALTED_HEX)])
def test_block_hashes_are_the_documented_chain(salt, expected):
    hasher = BlockHasher(FINGERPRINT.digest, 4)
    assert [h.hex() for h in hasher.hashes(TOKENS, salt)] == expected
    assert [h.hex() for h in documented_chain(bytes.fromhex(SEED_HEX), TOKENS, 4, salt)] == expected


def test_the_salt_extra_and_one_block_are_the_documented_bytes():
    assert salt_extra(SALT) == b"salt\x08\x00\x00\x00tenant-a"
    assert salt_extra(None) == salt_extra("") == b""
    assert hash_block(bytes.fromhex(SEED_HEX), TOKENS[:4]).hex() == UNSALTED_HEX[0]


@pytest.mark.parametrize("token", [2**32, -1, 2**64])
def test_a_token_id_outside_uint32_is_a_value_error(token):
    with pytest.raises(ValueError, match="2\\*\\*32"):
        BlockHasher(FINGERPRINT.digest, 4).hashes([1, 2, 3, token])
