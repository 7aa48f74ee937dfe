"""The record format: one self-describing, verifiable record per chunk.

    header (132 bytes, little-endian)
      magic "KVTR" | version u16 | flags u16 | dtype u8 | rank u8 | pad 2
      fingerprint 32 | block hash 32 | shape 8 x u32 (unused dims 0)
      raw payload length u64 | stored payload length u64 | xxh3-64 u64
    payload (stored length bytes: raw, or compressed per flags)
    HMAC-SHA256 (32 bytes, only with FLAG_HMAC) over header and payload

The xxh3-64 covers the header (minus the checksum field) and the stored payload, so a
flipped bit anywhere, including in flags or shape, is caught before anything is
interpreted. Decoding checks, in order: size and magic, version, flags and lengths,
checksum, HMAC (required when the store has a secret), fingerprint, block hash, dtype,
shape, then decompresses or copies into the caller's buffer. Nothing is unpickled or
evaluated; the decoder never allocates more than one chunk.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from dataclasses import dataclass

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
FORMAT_VERSION = 1
FLAG_LZ4 = 0x1
FLAG_LZ4_PLANES = 0x2
FLAG_HMAC = 0x4
_KNOWN_FLAGS = FLAG_LZ4 | FLAG_LZ4_PLANES | FLAG_HMAC
_CODEC_FLAGS = {Codec.NONE: 0, Codec.LZ4: FLAG_LZ4, Codec.LZ4_PLANES: FLAG_LZ4_PLANES}
_FLAG_CODECS = {flag: codec for codec, flag in _CODEC_FLAGS.items()}

_HEADER = struct.Struct(f"<4sHHBB2x32s32s{MAX_RANK}IQQQ")
HEADER_SIZE = _HEADER.size
_CHECKED_HEADER = HEADER_SIZE - 8  # everything but the checksum field
MAC_SIZE = 32


@dataclass(frozen=True, slots=True)
class RecordHeader:
    version: int
    flags: int
    dtype_code: int
    shape: tuple[int, ...]
    fingerprint: bytes
    block_hash: bytes
    raw_len: int
    payload_len: int
    checksum: int

    @property
    def codec(self) -> Codec:
        return _FLAG_CODECS[self.flags & (FLAG_LZ4 | FLAG_LZ4_PLANES)]

    @property
    def total_len(self) -> int:
        return HEADER_SIZE + self.payload_len + (MAC_SIZE if self.flags & FLAG_HMAC else 0)


def parse_header(record: Buffer) -> RecordHeader:
    """Structural checks only (size, magic, version, flags, rank, total length)."""
    view = memoryview(record)
    if view.nbytes < HEADER_SIZE:
        raise TruncatedRecordError(f"{view.nbytes} bytes is shorter than a record header")
    magic, version, flags, dtype_code, rank, fingerprint, block_hash, *rest = _HEADER.unpack_from(
        view
    )
    dims, (raw_len, payload_len, checksum) = rest[:MAX_RANK], rest[MAX_RANK:]
    if magic != MAGIC:
        raise BadMagicError("not a kvtier record")
    if version != FORMAT_VERSION:
        raise UnsupportedVersionError(
            f"record format version {version}, this build reads {FORMAT_VERSION}"
        )
    if flags & ~_KNOWN_FLAGS or (flags & FLAG_LZ4 and flags & FLAG_LZ4_PLANES):
        raise RecordFormatError(f"unknown flag combination {flags:#x}")
    if not 1 <= rank <= MAX_RANK or any(dims[rank:]):
        raise RecordFormatError(f"bad shape rank {rank}")
    header = RecordHeader(
        version,
        flags,
        dtype_code,
        tuple(dims[:rank]),
        fingerprint,
        block_hash,
        raw_len,
        payload_len,
        checksum,
    )
    if view.nbytes < header.total_len:
        raise TruncatedRecordError(f"record has {view.nbytes} of {header.total_len} bytes")
    if view.nbytes > header.total_len:
        raise RecordFormatError(f"record has {view.nbytes - header.total_len} trailing bytes")
    return header


class RecordCodec:
    """Encodes and decodes the records of one store (its spec, compression, secret)."""

    def __init__(
        self, spec: ChunkSpec, codec: Codec = Codec.NONE, secret: bytes | None = None
    ) -> None:
        self.spec = spec
        self.codec = codec
        self.secret = secret or None

    @property
    def max_record_size(self) -> int:
        """No valid record of this spec is larger (compression is kept only if it shrinks)."""
        return HEADER_SIZE + self.spec.nbytes + MAC_SIZE

    def new_staging(self) -> bytearray:
        """A buffer to copy a payload into (see `payload_view`) and `seal` in place."""
        return bytearray(self.max_record_size)

    def payload_view(self, staging: bytearray) -> memoryview:
        return memoryview(staging)[HEADER_SIZE : HEADER_SIZE + self.spec.nbytes]

    def seal(self, block_hash: bytes, staging: bytearray) -> memoryview:
        """Finish a record whose raw payload sits in `staging`; no copy unless compressed."""
        payload = self.payload_view(staging)
        segments = compress(self.codec, payload, self.spec.itemsize)
        if segments is None:
            return self._finish(block_hash, staging, 0, payload.nbytes)
        stored = sum(len(s) for s in segments)
        record = bytearray(HEADER_SIZE + stored + MAC_SIZE)
        offset = HEADER_SIZE
        for segment in segments:
            record[offset : offset + len(segment)] = segment
            offset += len(segment)
        return self._finish(block_hash, record, _CODEC_FLAGS[self.codec], stored)

    def encode(
        self, block_hash: bytes, payload: Buffer, staging: bytearray | None = None
    ) -> memoryview:
        """A record holding a copy of `payload`, built in `staging` (or a new buffer)."""
        staging = staging if staging is not None else self.new_staging()
        self.payload_view(staging)[:] = memoryview(payload).cast("B")
        return self.seal(block_hash, staging)

    def decode_into(self, block_hash: bytes, record: Buffer, out: memoryview) -> None:
        """Verify `record` and write its raw payload into `out` (spec.nbytes bytes).

        Raises a RecordError subclass if anything is wrong; `out` may then hold garbage."""
        view = memoryview(record).cast("B")
        header = parse_header(view)
        payload = view[HEADER_SIZE : HEADER_SIZE + header.payload_len]
        if self._checksum(view, payload) != header.checksum:
            raise ChecksumMismatchError("xxh3-64 mismatch")
        self._authenticate(header, view)
        self._check_identity(header, block_hash)
        if header.codec is Codec.NONE:
            if header.payload_len != header.raw_len:
                raise RecordFormatError("uncompressed payload length differs from raw length")
            out[:] = payload
        else:
            decompress_into(header.codec, payload, out, self.spec.itemsize)

    def _finish(self, block_hash: bytes, buf: bytearray, flags: int, stored: int) -> memoryview:
        spec = self.spec
        if self.secret:
            flags |= FLAG_HMAC
        dims = spec.shape + (0,) * (MAX_RANK - len(spec.shape))
        view = memoryview(buf)
        _HEADER.pack_into(
            view,
            0,
            MAGIC,
            FORMAT_VERSION,
            flags,
            spec.dtype_code,
            len(spec.shape),
            spec.fingerprint,
            block_hash,
            *dims,
            spec.nbytes,
            stored,
            0,
        )
        payload = view[HEADER_SIZE : HEADER_SIZE + stored]
        struct.pack_into("<Q", view, _CHECKED_HEADER, self._checksum(view, payload))
        end = HEADER_SIZE + stored
        if self.secret:
            view[end : end + MAC_SIZE] = self._mac(view[:end])
            end += MAC_SIZE
        return view[:end]

    @staticmethod
    def _checksum(record: memoryview, payload: memoryview) -> int:
        digest = xxhash.xxh3_64()
        digest.update(record[:_CHECKED_HEADER])
        digest.update(payload)
        return digest.intdigest()

    def _mac(self, signed: memoryview) -> bytes:
        return hmac.new(self.secret, signed, hashlib.sha256).digest()

    def _authenticate(self, header: RecordHeader, view: memoryview) -> None:
        if not self.secret:
            return
        if not header.flags & FLAG_HMAC:
            raise AuthenticationError("record is not signed and this store requires a secret")
        end = HEADER_SIZE + header.payload_len
        if not hmac.compare_digest(self._mac(view[:end]), view[end : end + MAC_SIZE]):
            raise AuthenticationError("HMAC-SHA256 mismatch (written with another secret?)")

    def _check_identity(self, header: RecordHeader, block_hash: bytes) -> None:
        spec = self.spec
        if header.fingerprint != spec.fingerprint:
            raise FingerprintMismatchError("record of another model fingerprint")
        if header.block_hash != block_hash:
            raise KeyMismatchError("record stored under another chunk's key")
        if (
            header.dtype_code != spec.dtype_code
            or header.shape != spec.shape
            or header.raw_len != spec.nbytes
        ):
            raise LayoutMismatchError(
                f"record dtype {header.dtype_code} shape {list(header.shape)}, store expects "
                f"{spec.dtype_code} {list(spec.shape)}"
            )
