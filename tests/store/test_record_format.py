"""Record format: bit-exact round trips, and every kind of bad record raises its own error."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
from kvstore.record import HEADER_SIZE, MAGIC, RecordCodec, parse_header
from kvstore.spec import tensor_bytes
from tests.store.store_helpers import bits_equal, chunk_payload, make_spec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
KEY = hashlib.sha256(b"key").digest()


def roundtrip(codec: RecordCodec, record: bytes | memoryview, key: bytes = KEY) -> torch.Tensor:
    out = torch.empty(codec.spec.shape, dtype=codec.spec.dtype)
    codec.decode_into(key, record, tensor_bytes(out))
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


def test_special_values_survive():
    spec = make_spec(torch.bfloat16)
    payload = chunk_payload(spec, 2)
    flat = payload.view(-1)
    flat[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    rc = RecordCodec(spec, Codec.LZ4_PLANES)
    assert bits_equal(roundtrip(rc, rc.encode(KEY, tensor_bytes(payload))), payload)


def test_byte_planes_compress_gaussian_bf16_where_plain_lz4_cannot():
    spec = make_spec(torch.bfloat16, chunk_tokens=256)
    payload = tensor_bytes(chunk_payload(spec, 6))
    plain = RecordCodec(spec, Codec.LZ4).encode(KEY, payload)
    planes = RecordCodec(spec, Codec.LZ4_PLANES).encode(KEY, payload)
    assert parse_header(plain).codec is Codec.NONE
    assert planes.nbytes < 0.9 * spec.nbytes


@pytest.mark.parametrize("codec", [Codec.LZ4, Codec.LZ4_PLANES])
def test_smooth_payload_compresses(codec):
    spec = make_spec(torch.bfloat16, chunk_tokens=256)
    record = RecordCodec(spec, codec).encode(KEY, tensor_bytes(smooth_payload(spec)))
    assert record.nbytes < 0.8 * spec.nbytes


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


@pytest.mark.parametrize("position", [0, 7, 20, 60, HEADER_SIZE - 1, HEADER_SIZE + 5, -40, -1])
def test_any_flipped_byte_is_detected(record_and_codec, position):
    record, rc = record_and_codec
    damaged = bytearray(record)
    damaged[position] ^= 0x10
    with pytest.raises(RecordError):
        roundtrip(rc, damaged)


def test_flipped_payload_byte_is_a_checksum_failure(record_and_codec):
    record, rc = record_and_codec
    damaged = bytearray(record)
    damaged[HEADER_SIZE + 100] ^= 1
    with pytest.raises(ChecksumMismatchError):
        roundtrip(rc, damaged)


def test_flipped_mac_byte_is_an_auth_failure(record_and_codec):
    record, rc = record_and_codec
    damaged = bytearray(record)
    damaged[-3] ^= 1
    with pytest.raises(AuthenticationError):
        roundtrip(rc, damaged)


@pytest.mark.parametrize("length", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 100])
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
        roundtrip(rc, record, key=hashlib.sha256(b"other").digest())


def test_record_of_another_layout_is_rejected():
    fp16 = RecordCodec(make_spec(torch.float16), Codec.NONE)
    record = fp16.encode(KEY, tensor_bytes(chunk_payload(fp16.spec, 5)))
    with pytest.raises(LayoutMismatchError):
        roundtrip(RecordCodec(make_spec(torch.bfloat16), Codec.NONE), record)


def test_future_format_version_is_rejected(record_and_codec):
    record, rc = record_and_codec
    newer = bytearray(record)
    struct.pack_into("<H", newer, 4, 2)
    with pytest.raises(UnsupportedVersionError):
        roundtrip(rc, newer)


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
