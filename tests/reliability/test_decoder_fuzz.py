"""Untrusted bytes meet only the fixed record decoder: adversarial records (crafted
headers with valid checksums, lying lengths, decompression bombs) raise the specific
RecordError and never allocate more than about a chunk; a huge value placed under a
valid key in Redis or on disk is read only up to the largest valid record size."""

from __future__ import annotations

import hashlib
import os
import struct
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import lz4.block
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scorecard import Scorecard

from bench.redis_server import RedisServer
from bench.store_io import load_tensors
from kvstore import RecordError, StoreConfig, TieredStore
from kvstore.record import FLAG_HMAC, FLAG_LZ4, FLAG_LZ4_PLANES, HEADER_SIZE, MAGIC, RecordCodec
from kvstore.spec import MAX_RANK, tensor_bytes
from tests.store.store_helpers import make_spec

pytestmark = pytest.mark.timeout(180)

SPEC = make_spec(torch.bfloat16, chunk_tokens=64)
CODEC = RecordCodec(SPEC)
KEY = hashlib.sha256(b"fuzzed chunk").digest()
HEADER = struct.Struct(f"<4sHHBBHI32s{MAX_RANK}IQQQQ")
MEMORY_BOUND = 4 * CODEC.max_record_size  # what one decode may allocate, at most
STORE_MEMORY_BOUND = 1024**2  # one load through a tier: a record buffer plus bookkeeping
HUGE_VALUE = 64 * 1024**2
EXAMPLES = 400
_allocations: list[int] = []


def seal(fields: dict, payload: bytes, fix_checksum: bool) -> bytes:
    """A record with these header fields; the checksums are made valid when asked, so
    that the checks after them are reached."""
    dims = list(fields["shape"]) + [0] * (MAX_RANK - len(fields["shape"]))
    hashes = b"".join(fields["block_hashes"])
    header = HEADER.pack(fields["magic"], fields["version"], fields["flags"], fields["dtype"],
                         fields["rank"], fields["num_blocks"], fields["first_block"], fields["fingerprint"],
                         *dims, fields["raw_len"], fields["payload_len"], fields["checksum"], fields["checksum"])
    record = bytearray(header + hashes + payload)
    if fix_checksum:
        struct.pack_into("<Q", record, HEADER_SIZE - 16, xxhash.xxh3_64(payload).intdigest())
        head = bytes(record[: HEADER_SIZE - 8]) + hashes
        struct.pack_into("<Q", record, HEADER_SIZE - 8, xxhash.xxh3_64(head).intdigest())
    return bytes(record)


def honest_fields(payload_len: int, flags: int = 0) -> dict:
    return {"magic": MAGIC, "version": 2, "flags": flags, "dtype": SPEC.dtype_code,
            "rank": len(SPEC.block_shape), "num_blocks": 1, "first_block": 0,
            "fingerprint": SPEC.fingerprint, "block_hashes": [KEY], "shape": SPEC.block_shape,
            "raw_len": SPEC.block_bytes, "payload_len": payload_len, "checksum": 0}


big = st.one_of(st.integers(0, 2**16), st.integers(0, 2**64 - 1), st.sampled_from([SPEC.nbytes, 2**63]))
mutations = st.fixed_dictionaries({}, optional={
    "flags": st.integers(0, 2**16 - 1) | st.sampled_from([FLAG_LZ4, FLAG_LZ4_PLANES, FLAG_HMAC]),
    "dtype": st.integers(0, 255),
    "rank": st.integers(0, 255),
    "shape": st.lists(st.integers(0, 2**32 - 1), max_size=MAX_RANK),
    "raw_len": big,
    "payload_len": big,
    "fingerprint": st.binary(min_size=32, max_size=32),
    "num_blocks": st.integers(0, 2**16 - 1),
    "first_block": st.integers(0, 2**32 - 1),
    "block_hashes": st.lists(st.binary(min_size=32, max_size=32), max_size=20),
})
payloads = st.one_of(
    st.binary(max_size=4096),
    st.binary(max_size=64).map(lambda b: lz4.block.compress(b * 4096, store_size=False)),
    st.integers(1, 8).map(lambda n: lz4.block.compress(bytes(n * 1024**2), store_size=False)),
    st.binary(max_size=64).map(lambda b: struct.pack("<I", 2**31) + b),
)


@st.composite
def adversarial_records(draw: st.DrawFn) -> bytes:
    payload = draw(payloads)
    flags = draw(st.sampled_from([0, FLAG_LZ4, FLAG_LZ4_PLANES]))
    fields = honest_fields(len(payload), flags) | draw(mutations)
    return seal(fields, payload, fix_checksum=draw(st.sampled_from([True, True, True, False])))


def decode_measured(record: bytes) -> tuple[RecordError | None, int]:
    """Decode into a chunk buffer: the RecordError raised (None if the record is valid)
    and the peak bytes allocated meanwhile. Any other exception fails the test."""
    out = torch.empty(SPEC.shape, dtype=SPEC.dtype)
    error = None
    tracemalloc.start()
    try:
        CODEC.decode_into(KEY, record, tensor_bytes(out))
    except RecordError as exc:
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(adversarial_records())
def test_adversarial_records_raise_record_errors_in_bounded_memory(record: bytes):
    _, peak = decode_measured(record)
    _allocations.append(peak)
    assert peak <= MEMORY_BOUND


def test_decompression_bombs_are_refused_without_inflating(scorecard: Scorecard):
    bombs = {
        "lz4 of 64 MiB of zeros": lz4.block.compress(bytes(HUGE_VALUE), store_size=False),
        "byte planes claiming a 2 GiB plane": struct.pack("<I", 2**31) + b"\0" * 64,
    }
    outcomes = {}
    for name, payload in bombs.items():
        flags = FLAG_LZ4 if name.startswith("lz4") else FLAG_LZ4_PLANES
        outcomes[name] = decode_measured(seal(honest_fields(len(payload), flags), payload, True))
    scorecard.add(
        "security", "decoder fed adversarial bytes", requests=len(_allocations) + len(bombs), wrong_outputs=0,
        faults=len(_allocations) + len(bombs),
        hypothesis_examples=len(_allocations), max_decode_allocation_bytes=max(_allocations, default=0),
        decode_allocation_bound_bytes=MEMORY_BOUND,
        **{f"{name}: allocated bytes": peak for name, (_, peak) in outcomes.items()},
    )
    for error, peak in outcomes.values():
        assert isinstance(error, RecordError) and peak <= MEMORY_BOUND


def plant_huge_value(store: TieredStore, name: str, server: RedisServer | None) -> None:
    """A value far larger than any record under a valid key: random bytes in Redis, a
    sparse file of zeros on disk."""
    if server is not None:
        server.client().set(store.lower[0].key_prefix + name, os.urandom(1024) * (HUGE_VALUE // 1024))
        return
    path = store.lower[0].path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(HUGE_VALUE)


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_huge_value_under_a_valid_key_is_read_in_bounded_memory(
    tier: str, redis_factory: Callable[[], RedisServer], tmp_path: Path, scorecard: Scorecard
):
    server = redis_factory() if tier == "redis" else None
    options = {"kv_offload": tier, "kv_offload_disk_path": str(tmp_path), "kv_redis_url": server and server.url}
    with TieredStore.from_config(SPEC, StoreConfig(**options)) as store:
        key = store.manager.key([KEY])
        plant_huge_value(store, key.name, server)
        out = torch.empty(SPEC.shape, dtype=SPEC.dtype)
        tracemalloc.start()
        try:
            result = load_tensors(store, [key], [out]).result(30)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        counters = store.stats().tiers[tier].counters
    scorecard.add(
        "security", f"{HUGE_VALUE >> 20} MiB value under a valid {tier} key", requests=1, wrong_outputs=0,
        faults=1,
        allocated_bytes=peak, bound_bytes=STORE_MEMORY_BOUND, rejected=counters["checksum_failures"],
    )
    assert result.ok == (False,)
    assert counters["checksum_failures"] == 1
    assert peak <= STORE_MEMORY_BOUND
