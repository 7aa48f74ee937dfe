"""Record format: literal test vectors of the documented layout, bit-exact round trips,
and every kind of bad record raises its own error."""

from __future__ import annotations

import hashlib
import hmac
import struct

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import ChunkSpec
from kvstore.compression import Codec, resolve_codec
from kvstore.errors import (
    AuthenticationError,
    BadMagicError,
    ChecksumMismatchError,
    FingerprintMismatchError,
    KeyMismatchError,
    LayoutMismatchError,
    RecordError,
    TruncatedRecordError,
    UnsupportedVersionError,
)
from kvstore.keys import ChunkKeyer
from kvstore.record import FORMAT_VERSION, HEADER_SIZE, MAGIC, RecordCodec, parse_head, parse_header
from kvstore.spec import tensor_bytes
from tests.store.store_helpers import bits_equal, chunk_payload, make_spec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# The vector: a tail record of 1 block at block 2 of a sequence, for a store of
# 2-block chunks of blocks [1 layer, K/V, 1 token, 1 head, head_dim 2] in fp32.
VECTOR_SPEC = ChunkSpec(bytes(range(32)), (2, 1, 2, 1, 1, 2), torch.float32, 2)
VECTOR_HASH = hashlib.sha256(b"block-2").digest()
VECTOR_PAYLOAD = struct.pack("<4f", 1.0, -2.0, 0.5, 3.0)
VECTOR_NAME = (
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f-2-v2-"
    "2453695514ac2ba4f06e40a20e20cbc76b7a6c6d9a438c4a30e2acea3be39f57"
)
VECTOR = bytes.fromhex(
    "4b565452" "0200" "0000" "01" "05" "0100" "02000000"  # magic, v2, flags, fp32, rank 5, 1 block, block 2
    "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f"  # fingerprint
    "01000000" "02000000" "01000000" "01000000" "02000000" "000000000000000000000000"  # block shape
    "1000000000000000" "1000000000000000"  # raw and stored payload length
    "cf45bf90347721d1" "431afc6354db745e"  # payload xxh3-64, head xxh3-64
    "2453695514ac2ba4f06e40a20e20cbc76b7a6c6d9a438c4a30e2acea3be39f57"  # block hash
    "0000803f000000c00000003f00004040"  # payload: 1.0, -2.0, 0.5, 3.0
)
VECTOR_MAC = bytes.fromhex("ae070c2ec4fc30463e68bd75e16a4d905fdb70b492d86a8c2253778a359e03d0")


def vector_key():
    return ChunkKeyer(VECTOR_SPEC.fingerprint, 2, 2).key([VECTOR_HASH], first_block=2)


def test_the_record_of_the_vector_is_exactly_the_documented_bytes():
    key = vector_key()
    assert key.name == VECTOR_NAME
    assert bytes(RecordCodec(VECTOR_SPEC).encode(key, VECTOR_PAYLOAD)) == VECTOR


def test_the_vector_follows_the_documented_layout_field_by_field():
    fixed = VECTOR[:HEADER_SIZE]
    assert HEADER_SIZE == 112 and FORMAT_VERSION == 2
    assert struct.unpack_from("<4sHHBBHI", fixed) == (b"KVTR", 2, 0, 1, 5, 1, 2)
    assert fixed[16:48] == bytes(range(32))
    assert struct.unpack_from("<8I", fixed, 48) == (1, 2, 1, 1, 2, 0, 0, 0)
    raw, stored, payload_checksum, head_checksum = struct.unpack_from("<QQQQ", fixed, 80)
    assert (raw, stored) == (16, 16)
    hashes, payload = VECTOR[HEADER_SIZE : HEADER_SIZE + 32], VECTOR[HEADER_SIZE + 32 :]
    assert hashes == VECTOR_HASH and payload == VECTOR_PAYLOAD
    assert payload_checksum == xxhash.xxh3_64(payload).intdigest()
    assert head_checksum == xxhash.xxh3_64(fixed[:104] + hashes).intdigest()  # all of the head but itself


def test_the_signed_vector_appends_an_hmac_over_header_and_payload():
    signed = bytes(RecordCodec(VECTOR_SPEC, secret=b"k").encode(vector_key(), VECTOR_PAYLOAD))
    header, mac = signed[:-32], signed[-32:]
    assert struct.unpack_from("<H", header, 6) == (0x4,)  # FLAG_HMAC
    assert mac == VECTOR_MAC == hmac.new(b"k", header, hashlib.sha256).digest()
    assert header[HEADER_SIZE:] == VECTOR[HEADER_SIZE:]


def test_the_vector_decodes_and_its_head_parses_alone():
    out = bytearray(16)
    header = RecordCodec(VECTOR_SPEC).decode_into(VECTOR_HASH, VECTOR, memoryview(out))
    assert bytes(out) == VECTOR_PAYLOAD
    assert (header.first_block, header.num_blocks, header.block_hashes) == (2, 1, (VECTOR_HASH,))
    assert parse_head(VECTOR[: HEADER_SIZE + 32]) == parse_header(VECTOR)


KEYER = ChunkKeyer(make_spec().fingerprint, 16, 4)
HASHES = tuple(hashlib.sha256(f"key-{i}".encode()).digest() for i in range(4))
KEY = KEYER.key(HASHES)


def roundtrip(codec: RecordCodec, record: bytes | memoryview, block_hash: bytes = HASHES[-1]) -> torch.Tensor:
    out = torch.empty(codec.spec.shape, dtype=codec.spec.dtype)
    codec.decode_into(block_hash, record, tensor_bytes(out))
    return out


def smooth_payload(spec) -> torch.Tensor:
    """Values with structure (like real KV): compressible, unlike random ones."""
    grid = torch.linspace(0, 6.28, steps=torch.Size(spec.shape).numel()).reshape(spec.shape)
    return (torch.sin(grid) * 3 + 0.01 * torch.cos(grid * 50)).to(spec.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_roundtrip_is_bit_exact(dtype, codec, secret):
    spec = make_spec(dtype)
    rc = RecordCodec(spec, codec, secret)
    for payload in (chunk_payload(spec, 1), smooth_payload(spec)):
        assert bits_equal(roundtrip(rc, rc.encode(KEY, tensor_bytes(payload))), payload)


def test_a_tail_record_holds_only_its_blocks():
    spec = make_spec()
    rc = RecordCodec(spec)
    key = KEYER.key(HASHES[:2], first_block=4)
    payload = chunk_payload(spec, 2)[:2]
    record = rc.encode(key, tensor_bytes(payload))
    assert record.nbytes == HEADER_SIZE + 2 * 32 + 2 * spec.block_bytes
    out = torch.empty(spec.shape, dtype=spec.dtype)
    header = rc.decode_into(HASHES[1], record, tensor_bytes(out))
    assert header.first_block == 4 and bits_equal(out[:2], payload)


def test_special_values_survive():
    spec = make_spec(torch.bfloat16)
    payload = chunk_payload(spec, 2)
    flat = payload.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    rc = RecordCodec(spec, Codec.LZ4_PLANES)
    assert bits_equal(roundtrip(rc, rc.encode(KEY, tensor_bytes(payload))), payload)


def full_key(spec) -> object:
    """A key of a full record of `spec` (256-token chunks: 64 blocks)."""
    return ChunkKeyer(spec.fingerprint, 256, 64).key([hashlib.sha256(bytes([i])).digest() for i in range(64)])


def test_byte_planes_compress_gaussian_bf16_where_plain_lz4_cannot():
    spec = make_spec(torch.bfloat16, chunk_tokens=256)
    key = full_key(spec)
    payload = tensor_bytes(chunk_payload(spec, 6))
    plain = RecordCodec(spec, Codec.LZ4).encode(key, payload)
    planes = RecordCodec(spec, Codec.LZ4_PLANES).encode(key, payload)
    assert parse_header(plain).codec is Codec.NONE
    assert planes.nbytes - HEADER_SIZE - 64 * 32 < 0.9 * spec.nbytes


@pytest.mark.parametrize("codec", [Codec.LZ4, Codec.LZ4_PLANES])
def test_smooth_payload_compresses(codec):
    spec = make_spec(torch.bfloat16, chunk_tokens=256)
    record = RecordCodec(spec, codec).encode(full_key(spec), tensor_bytes(smooth_payload(spec)))
    assert record.nbytes - HEADER_SIZE - 64 * 32 < 0.8 * spec.nbytes


def test_incompressible_payload_is_stored_raw():
    spec = make_spec(torch.float32)
    record = RecordCodec(spec, Codec.LZ4).encode(KEY, tensor_bytes(chunk_payload(spec, 3)))
    assert parse_header(record).codec is Codec.NONE


def test_lz4_option_picks_byte_planes_for_wide_dtypes():
    assert resolve_codec("lz4", 2) is Codec.LZ4_PLANES
    assert resolve_codec(None, 2) is Codec.NONE


@pytest.fixture
def record_and_codec():
    spec = make_spec(torch.bfloat16)
    rc = RecordCodec(spec, Codec.NONE, b"secret")
    return bytes(rc.encode(KEY, tensor_bytes(chunk_payload(spec, 4)))), rc


@pytest.mark.parametrize("position", [0, 7, 12, 20, 60, HEADER_SIZE - 1, HEADER_SIZE + 5, -40, -1])
def test_any_flipped_byte_is_detected(record_and_codec, position):
    record, rc = record_and_codec
    damaged = bytearray(record)
    damaged[position] ^= 0x10
    with pytest.raises(RecordError):
        roundtrip(rc, damaged)


def test_a_flipped_block_hash_is_a_checksum_failure_of_the_head_alone(record_and_codec):
    record, rc = record_and_codec
    damaged = bytearray(record)
    damaged[HEADER_SIZE + 3] ^= 1  # the first block's hash
    with pytest.raises(ChecksumMismatchError):
        roundtrip(rc, damaged)
    with pytest.raises(ChecksumMismatchError):
        parse_head(damaged[: HEADER_SIZE + 4 * 32])
    assert parse_head(record[: HEADER_SIZE + 4 * 32]).block_hashes == HASHES


def test_flipped_payload_byte_is_a_checksum_failure(record_and_codec):
    record, rc = record_and_codec
    damaged = bytearray(record)
    damaged[HEADER_SIZE + 4 * 32 + 100] ^= 1
    with pytest.raises(ChecksumMismatchError):
        roundtrip(rc, damaged)


def test_flipped_mac_byte_is_an_auth_failure(record_and_codec):
    record, rc = record_and_codec
    damaged = bytearray(record)
    damaged[-3] ^= 1
    with pytest.raises(AuthenticationError):
        roundtrip(rc, damaged)


@pytest.mark.parametrize("length", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 100, HEADER_SIZE + 200])
def test_truncated_record(record_and_codec, length):
    record, rc = record_and_codec
    with pytest.raises(TruncatedRecordError):
        roundtrip(rc, record[:length])


def test_other_secret_and_unsigned_records_are_rejected(record_and_codec):
    record, rc = record_and_codec
    with pytest.raises(AuthenticationError):
        roundtrip(RecordCodec(rc.spec, Codec.NONE, b"other"), record)
    unsigned = RecordCodec(rc.spec, Codec.NONE).encode(KEY, tensor_bytes(chunk_payload(rc.spec, 4)))
    with pytest.raises(AuthenticationError):
        roundtrip(rc, unsigned)


def test_record_of_another_model_is_rejected(record_and_codec):
    record, _ = record_and_codec
    other = RecordCodec(make_spec(torch.bfloat16, fingerprint=b"\x01" * 32), Codec.NONE, b"secret")
    with pytest.raises(FingerprintMismatchError):
        roundtrip(other, record)


def test_record_under_another_key_is_rejected(record_and_codec):
    record, rc = record_and_codec
    with pytest.raises(KeyMismatchError):
        roundtrip(rc, record, block_hash=hashlib.sha256(b"other").digest())


def test_record_of_another_layout_is_rejected():
    fp16 = RecordCodec(make_spec(torch.float16), Codec.NONE)
    record = fp16.encode(KEY, tensor_bytes(chunk_payload(fp16.spec, 5)))
    with pytest.raises(LayoutMismatchError):
        roundtrip(RecordCodec(make_spec(torch.bfloat16), Codec.NONE), record)


def test_other_format_versions_are_rejected(record_and_codec):
    record, rc = record_and_codec
    for version in (1, 3):
        other = bytearray(record)
        struct.pack_into("<H", other, 4, version)
        with pytest.raises(UnsupportedVersionError):
            roundtrip(rc, other)


def test_foreign_bytes_are_rejected(record_and_codec):
    _, rc = record_and_codec
    with pytest.raises(BadMagicError):
        roundtrip(rc, b"\x80\x04\x95" + b"\x00" * 4000)  # a pickle is just bytes here


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_only_raise_record_errors(data):
    rc = RecordCodec(make_spec(torch.bfloat16), Codec.LZ4_PLANES)
    with pytest.raises(RecordError):
        roundtrip(rc, MAGIC + data)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0), st.integers(min_value=0, max_value=255))
def test_single_byte_corruption_of_compressed_record(seed, value):
    spec = make_spec(torch.bfloat16)
    rc = RecordCodec(spec, Codec.LZ4_PLANES)
    record = bytearray(rc.encode(KEY, tensor_bytes(smooth_payload(spec))))
    position = seed % len(record)
    if record[position] == value:
        return
    record[position] = value
    with pytest.raises(RecordError):
        roundtrip(rc, record)


# ---- records read with some blocks placed elsewhere (scatter) ---------------------------


def scattered_read(rc: RecordCodec, record: memoryview, num_blocks: int, placed_blocks: list[int]):
    """Read `record` as a disk read into `scatter` pieces does; the placed blocks land in
    buffers of their own. Returns the pieces and those buffers."""
    slot = memoryview(bytearray(rc.slot_bytes))
    placed = {b: memoryview(bytearray(rc.spec.block_bytes)) for b in placed_blocks}
    pieces = rc.scatter(slot, num_blocks, placed)
    data, at = bytes(record), 0
    for piece in pieces:
        count = min(piece.nbytes, len(data) - at)
        piece[:count] = data[at : at + count]
        at += count
    assert at == len(data)
    return pieces, placed


@pytest.mark.parametrize("secret", [None, b"s3cret"])
def test_a_scattered_record_verifies_and_its_placed_blocks_hold_the_payload(secret):
    spec = make_spec()
    rc = RecordCodec(spec, Codec.NONE, secret)
    payload = chunk_payload(spec, 3)
    record = rc.encode(KEY, tensor_bytes(payload))
    pieces, placed = scattered_read(rc, record, spec.blocks_per_chunk, [0, 2, 3])
    header = rc.verify_scattered(HASHES[-1], pieces, record.nbytes)
    assert header is not None and header.num_blocks == spec.blocks_per_chunk
    raw = bytes(tensor_bytes(payload))
    for block, memory in placed.items():
        assert bytes(memory) == raw[block * spec.block_bytes : (block + 1) * spec.block_bytes]
    assert bytes(pieces[2]) == raw[spec.block_bytes : 2 * spec.block_bytes]  # block 1 stayed in the slot


def test_a_flipped_byte_in_a_placed_block_fails_the_scattered_check():
    spec = make_spec()
    rc = RecordCodec(spec)
    record = rc.encode(KEY, tensor_bytes(chunk_payload(spec, 4)))
    pieces, placed = scattered_read(rc, record, spec.blocks_per_chunk, [1])
    placed[1][5] ^= 1
    with pytest.raises(ChecksumMismatchError):
        rc.verify_scattered(HASHES[-1], pieces, record.nbytes)


def test_a_scattered_record_must_be_as_long_as_its_header_says_and_carry_the_secret():
    spec = make_spec()
    record = RecordCodec(spec).encode(KEY, tensor_bytes(chunk_payload(spec, 5)))
    pieces, _ = scattered_read(RecordCodec(spec), record, spec.blocks_per_chunk, [0])
    with pytest.raises(TruncatedRecordError):
        RecordCodec(spec).verify_scattered(HASHES[-1], pieces, record.nbytes - 1)
    with pytest.raises(AuthenticationError):
        RecordCodec(spec, Codec.NONE, b"s3cret").verify_scattered(HASHES[-1], pieces, record.nbytes)


def test_a_compressed_record_is_not_placed_but_read_whole():
    spec = make_spec()
    rc = RecordCodec(spec, Codec.LZ4)
    grid = torch.zeros(spec.shape, dtype=spec.dtype)  # compresses
    record = rc.encode(KEY, tensor_bytes(grid))
    assert record.nbytes < spec.nbytes
    slot = memoryview(bytearray(rc.slot_bytes))
    pieces = rc.scatter(slot, spec.blocks_per_chunk, {})
    pieces[0][:] = bytes(record)[: pieces[0].nbytes]
    assert rc.verify_scattered(HASHES[-1], pieces, record.nbytes) is None
