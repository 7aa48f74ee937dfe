"""The record format: one self-describing, verifiable record per run of blocks.

    header (112 + 32 * n bytes, little-endian)
      magic "KVTR" | version u16 (2) | flags u16 | dtype u8 | rank u8 | n u16 | first block u32
      fingerprint 32 | block shape 8 x u32 (unused dims 0)
      raw payload length u64 | stored payload length u64
      payload xxh3-64 u64 | head xxh3-64 u64
      n block hashes, 32 bytes each, in block order
    payload (stored length bytes: n blocks of the block shape, raw or compressed per flags)
    HMAC-SHA256 (32 bytes, only with FLAG_HMAC) over header and payload

A record holds blocks [first block, first block + n) of one sequence; `rank` is the rank
of one block's shape. The head xxh3-64 covers the header up to it (the payload checksum
included) and the block hashes, so the head can be verified alone (a directory scan
indexes records from their first bytes); the payload xxh3-64 covers the stored payload.
A flipped bit anywhere, in flags, shape, a block hash or the payload, is caught before
anything is interpreted. Decoding checks, in order: size and magic, version, flags,
rank, block count and lengths, head checksum, payload checksum, HMAC (required when the
store has a secret), fingerprint, last block hash (the record's name), dtype, block
shape, then decompresses or copies. Nothing is unpickled or evaluated; the decoder never
allocates more than one record.

Version 1 (one 132-byte header with the last block hash only, every record a full
chunk) is not read by this build: its records live under another key namespace
(kvstore.keys), so they are neither found nor deleted, and age out of shared tiers.

In host memory a record sits in a slot (`RecordCodec.slot_bytes`): its header ends at
the fixed `payload_offset`, where the payload starts, so the payload is a tensor view of
the slot and the whole record is one contiguous run of the slot's bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import xxhash

from kvstore.compression import Codec, compress, decompress_into
from kvstore.errors import (
    AuthenticationError,
    BadMagicError,
    ChecksumMismatchError,
    FingerprintMismatchError,
    KeyMismatchError,
    LayoutMismatchError,
    RecordFormatError,
    TruncatedRecordError,
    UnsupportedVersionError,
)
from kvstore.spec import MAX_RANK, ChunkSpec

Buffer = bytes | bytearray | memoryview

MAGIC = b"KVTR"
FORMAT_VERSION = 2
FLAG_LZ4 = 0x1
FLAG_LZ4_PLANES = 0x2
FLAG_HMAC = 0x4
_KNOWN_FLAGS = FLAG_LZ4 | FLAG_LZ4_PLANES | FLAG_HMAC
_CODEC_FLAGS = {Codec.NONE: 0, Codec.LZ4: FLAG_LZ4, Codec.LZ4_PLANES: FLAG_LZ4_PLANES}
_FLAG_CODECS = {flag: codec for codec, flag in _CODEC_FLAGS.items()}

_HEADER = struct.Struct(f"<4sHHBBHI32s{MAX_RANK}IQQQQ")
HEADER_SIZE = _HEADER.size  # the fixed part, before the block hashes
_HEAD_CHECKSUM_AT = HEADER_SIZE - 8
_PAYLOAD_CHECKSUM_AT = HEADER_SIZE - 16
HASH_SIZE = 32
MAC_SIZE = 32
SLOT_ALIGN = 64


def header_size(num_blocks: int) -> int:
    return HEADER_SIZE + HASH_SIZE * num_blocks


@dataclass(frozen=True, slots=True)
class RecordHeader:
    version: int
    flags: int
    dtype_code: int
    block_shape: tuple[int, ...]
    num_blocks: int
    first_block: int
    fingerprint: bytes
    raw_len: int
    payload_len: int
    checksum: int  # of the stored payload
    block_hashes: tuple[bytes, ...]

    @property
    def codec(self) -> Codec:
        return _FLAG_CODECS[self.flags & (FLAG_LZ4 | FLAG_LZ4_PLANES)]

    @property
    def header_len(self) -> int:
        return header_size(self.num_blocks)

    @property
    def total_len(self) -> int:
        return self.header_len + self.payload_len + (MAC_SIZE if self.flags & FLAG_HMAC else 0)


def parse_header(record: Buffer) -> RecordHeader:
    """Structural checks only (size, magic, version, flags, rank, block count, total
    length)."""
    return _parse(memoryview(record).cast("B"), complete=True)


def parse_head(head: Buffer) -> RecordHeader:
    """The header of a record of which only the first bytes are given (at least the
    header with its block hashes): structural checks and the head checksum, without the
    total length."""
    return _parse(memoryview(head).cast("B"), complete=False)


def _parse(view: memoryview, complete: bool) -> RecordHeader:
    if view.nbytes < HEADER_SIZE:
        raise TruncatedRecordError(f"{view.nbytes} bytes is shorter than a record header")
    fields = _HEADER.unpack_from(view)
    magic, version, flags, dtype_code, rank, num_blocks, first_block, fingerprint = fields[:8]
    dims = fields[8 : 8 + MAX_RANK]
    raw_len, payload_len, checksum, head_checksum = fields[8 + MAX_RANK :]
    if magic != MAGIC:
        raise BadMagicError("not a kvtier record")
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"record format version {version}, this build reads {FORMAT_VERSION}"
        )
    if flags & ~_KNOWN_FLAGS or (flags & FLAG_LZ4 and flags & FLAG_LZ4_PLANES):
        raise RecordFormatError(f"unknown flag combination {flags:#x}")
    if not 1 <= rank <= MAX_RANK or any(dims[rank:]):
        raise RecordFormatError(f"bad block shape rank {rank}")
    if num_blocks < 1:
        raise RecordFormatError("a record holds at least one block")
    end = header_size(num_blocks)
    if view.nbytes < end:
        raise TruncatedRecordError(f"record has {view.nbytes} of its {end} header bytes")
    if _head_checksum(view, end) != head_checksum:
        raise ChecksumMismatchError("head xxh3-64 mismatch")
    hashes = tuple(bytes(view[at : at + HASH_SIZE]) for at in range(HEADER_SIZE, end, HASH_SIZE))
    header = RecordHeader(
        version, flags, dtype_code, tuple(dims[:rank]), num_blocks, first_block, fingerprint,
        raw_len, payload_len, checksum, hashes,
    )
    if complete:
        if view.nbytes < header.total_len:
            raise TruncatedRecordError(f"record has {view.nbytes} of {header.total_len} bytes")
        if view.nbytes > header.total_len:
            raise RecordFormatError(f"record has {view.nbytes - header.total_len} trailing bytes")
    return header


class RecordCodec:
    """Encodes and verifies the records of one store (its spec, compression, secret)."""

    def __init__(
        self, spec: ChunkSpec, codec: Codec = Codec.NONE, secret: bytes | None = None
    ) -> None:
        self.spec = spec
        self.codec = codec
        self.secret = secret or None
        full_header = header_size(spec.blocks_per_chunk)
        self.payload_offset = -(-full_header // SLOT_ALIGN) * SLOT_ALIGN

    @property
    def slot_bytes(self) -> int:
        """Host memory that holds any record of this spec in slot layout."""
        return self.payload_offset + self.spec.nbytes + MAC_SIZE

    @property
    def max_record_size(self) -> int:
        """No valid record of this spec is larger (compression is kept only if it shrinks)."""
        return header_size(self.spec.blocks_per_chunk) + self.spec.nbytes + MAC_SIZE

    @property
    def head_size(self) -> int:
        """Bytes enough to parse the header of any record of this spec (`parse_head`)."""
        return header_size(self.spec.blocks_per_chunk)

    def region(self, slot: memoryview, num_blocks: int) -> memoryview:
        """Where a record of `num_blocks` blocks lies in a slot: from its header start to
        the end of the slot (a tier reads a record into it)."""
        return slot[self.payload_offset - header_size(num_blocks) :]

    def payload(self, slot: memoryview, num_blocks: int) -> memoryview:
        return slot[self.payload_offset : self.payload_offset + num_blocks * self.spec.block_bytes]

    def scatter(self, slot: memoryview, num_blocks: int, placed: Mapping[int, memoryview]) -> list[memoryview]:
        """Where a raw record of `num_blocks` blocks is read when some of its blocks land
        elsewhere: its header region in the slot, then block b at `placed[b]` or at its
        place in the slot's payload, then the rest of the slot (the MAC, if any)."""
        block_bytes = self.spec.block_bytes
        payload = self.payload(slot, num_blocks)
        blocks = [placed.get(b, payload[b * block_bytes : (b + 1) * block_bytes]) for b in range(num_blocks)]
        header = slot[self.payload_offset - header_size(num_blocks) : self.payload_offset]
        return [header, *blocks, slot[self.payload_offset + num_blocks * block_bytes :]]

    def verify_scattered(self, block_hash: bytes, pieces: Sequence[memoryview], length: int) -> RecordHeader | None:
        """`verify` for a record of `length` bytes read into `scatter` pieces. None when it
        is compressed (its payload does not fall on the block pieces: read it whole);
        raises a RecordError subclass if anything is wrong."""
        header = parse_head(pieces[0])
        if header.codec is not Codec.NONE:
            return None
        if header.total_len != length:
            raise TruncatedRecordError(f"record of {length} bytes, its header says {header.total_len}")
        if len(pieces) != header.num_blocks + 2:
            raise LayoutMismatchError(f"a record of {header.num_blocks} blocks read as {len(pieces) - 2}")
        if header.payload_len != header.raw_len or header.raw_len != header.num_blocks * self.spec.block_bytes:
            raise RecordFormatError("uncompressed payload length differs from raw length")
        self._check_payload(header, block_hash, pieces[0], pieces[1:-1], pieces[-1][:MAC_SIZE])
        return header

    def seal(self, key: _Key, slot: memoryview) -> memoryview:
        """The record of `key` whose raw payload sits in `slot` (slot layout): the header
        and MAC are written around it in place and the record is a view of the slot, or,
        when compression shrinks it, a new buffer."""
        payload = self.payload(slot, key.num_blocks)
        segments = compress(self.codec, payload, self.spec.itemsize)
        if segments is None:
            return self._finish(key, self.region(slot, key.num_blocks), 0, payload.nbytes)
        stored = sum(len(s) for s in segments)
        record = bytearray(header_size(key.num_blocks) + stored + MAC_SIZE)
        offset = header_size(key.num_blocks)
        for segment in segments:
            record[offset : offset + len(segment)] = segment
            offset += len(segment)
        return self._finish(key, memoryview(record), _CODEC_FLAGS[self.codec], stored)

    def encode(self, key: _Key, payload: Buffer) -> memoryview:
        """A record holding a copy of `payload` (`key.num_blocks` blocks), in a new buffer."""
        slot = memoryview(bytearray(self.slot_bytes))
        self.payload(slot, key.num_blocks)[:] = memoryview(payload).cast("B")
        return self.seal(key, slot)

    def verify(self, block_hash: bytes, record: Buffer) -> tuple[RecordHeader, memoryview]:
        """Check `record` whole and that it is a record of this store named by the hash of
        its last block `block_hash`; its header and stored payload. Raises a RecordError
        subclass if anything is wrong."""
        view = memoryview(record).cast("B")
        header = parse_header(view)
        end = header.header_len + header.payload_len
        payload = view[header.header_len : end]
        self._check_payload(header, block_hash, view[: header.header_len], [payload], view[end : end + MAC_SIZE])
        return header, payload

    def decode_into(self, block_hash: bytes, record: Buffer, out: memoryview) -> RecordHeader:
        """Verify `record` and write its raw payload into the first bytes of `out`.

        Raises a RecordError subclass if anything is wrong; `out` may then hold garbage."""
        header, payload = self.verify(block_hash, record)
        if out.nbytes < header.raw_len:
            raise LayoutMismatchError(f"{header.raw_len} payload bytes do not fit {out.nbytes}")
        self._unpack(header, payload, memoryview(out).cast("B")[: header.raw_len])
        return header

    def settle_in_slot(self, block_hash: bytes, slot: memoryview, record: memoryview) -> RecordHeader:
        """Verify a record a tier read into `slot` at `region(slot, n)` and leave its raw
        payload at the slot's payload offset: nothing to move for a raw record, a
        decompression for a compressed one."""
        header, payload = self.verify(block_hash, record)
        if header.codec is not Codec.NONE:
            # The compressed bytes overlap the payload they decompress into.
            self._unpack(header, memoryview(bytes(payload)), self.payload(slot, header.num_blocks))
        elif header.payload_len != header.raw_len:
            raise RecordFormatError("uncompressed payload length differs from raw length")
        return header

    def _unpack(self, header: RecordHeader, payload: memoryview, out: memoryview) -> None:
        if header.codec is Codec.NONE:
            if header.payload_len != header.raw_len:
                raise RecordFormatError("uncompressed payload length differs from raw length")
            out[:] = payload
        else:
            decompress_into(header.codec, payload, out, self.spec.itemsize)

    def _finish(self, key: _Key, buf: memoryview, flags: int, stored: int) -> memoryview:
        spec = self.spec
        if self.secret:
            flags |= FLAG_HMAC
        dims = spec.block_shape + (0,) * (MAX_RANK - len(spec.block_shape))
        n = key.num_blocks
        end = header_size(n) + stored
        _HEADER.pack_into(
            buf, 0, MAGIC, FORMAT_VERSION, flags, spec.dtype_code, len(spec.block_shape), n,
            key.first_block, spec.fingerprint, *dims, n * spec.block_bytes, stored,
            xxhash.xxh3_64_intdigest(buf[header_size(n) : end]), 0,
        )
        for index, block_hash in enumerate(key.block_hashes):
            at = HEADER_SIZE + index * HASH_SIZE
            buf[at : at + HASH_SIZE] = block_hash
        struct.pack_into("<Q", buf, _HEAD_CHECKSUM_AT, _head_checksum(buf, header_size(n)))
        if self.secret:
            buf[end : end + MAC_SIZE] = self._mac(buf[:end])
            end += MAC_SIZE
        return buf[:end]

    def _mac(self, *signed: Buffer) -> bytes:
        mac = hmac.new(self.secret, digestmod=hashlib.sha256)
        for piece in signed:
            mac.update(piece)
        return mac.digest()

    def _check_payload(self, header: RecordHeader, block_hash: bytes, head: Buffer,
                       payload: Sequence[Buffer], mac: Buffer) -> None:
        """The payload checksum, the HMAC (when the store has a secret) and the
        identity of a record whose header bytes are `head` and whose stored payload is
        the concatenation of `payload`."""
        digest = xxhash.xxh3_64()
        for piece in payload:
            digest.update(piece)
        if digest.intdigest() != header.checksum:
            raise ChecksumMismatchError("payload xxh3-64 mismatch")
        if self.secret:
            if not header.flags & FLAG_HMAC:
                raise AuthenticationError("record is not signed and this store requires a secret")
            if not hmac.compare_digest(self._mac(head, *payload), mac):
                raise AuthenticationError("HMAC-SHA256 mismatch (written with another secret?)")
        self.check_identity(header, block_hash)

    def check_identity(self, header: RecordHeader, block_hash: bytes) -> None:
        """That `header` is of a record of this store named by `block_hash` (its last
        block's hash); raises a RecordError subclass otherwise."""
        spec = self.spec
        if header.fingerprint != spec.fingerprint:
            raise FingerprintMismatchError("record of another model fingerprint")
        if header.block_hashes[-1] != block_hash:
            raise KeyMismatchError("record stored under another record's key")
        if (
            header.dtype_code != spec.dtype_code
            or header.block_shape != spec.block_shape
            or header.num_blocks > spec.blocks_per_chunk
            or header.first_block % spec.blocks_per_chunk
            or header.raw_len != header.num_blocks * spec.block_bytes
        ):
            raise LayoutMismatchError(
                f"record dtype {header.dtype_code} blocks {header.num_blocks} x "
                f"{list(header.block_shape)} from block {header.first_block}, store expects "
                f"{spec.dtype_code} up to {spec.blocks_per_chunk} x {list(spec.block_shape)}"
            )


def _head_checksum(record: memoryview, header_len: int) -> int:
    """xxh3-64 of the header up to the head checksum, and of the block hashes."""
    digest = xxhash.xxh3_64()
    digest.update(record[:_HEAD_CHECKSUM_AT])
    digest.update(record[HEADER_SIZE:header_len])
    return digest.intdigest()


class _Key(Protocol):
    """What `seal` and `encode` read of a record key (kvstore.keys.ChunkKey)."""

    @property
    def first_block(self) -> int: ...

    @property
    def block_hashes(self) -> Sequence[bytes]: ...

    @property
    def num_blocks(self) -> int: ...
