"""Payload compression: plain lz4, or lz4 on the most significant byte plane only.

KV values of one layer share a narrow range of exponents, so the byte holding sign and
exponent (the most significant byte of each little-endian element; for bf16 sign + 7
exponent bits) repeats a lot, while mantissa bytes are close to random. `LZ4_PLANES`
splits the payload into byte planes, lz4-compresses the most significant one and stores
the others as they are; plain lz4 on interleaved bytes finds few matches.

Stored layout of LZ4_PLANES: u32 LE length of the compressed plane, the compressed most
significant plane, then the other planes from least significant up, each n bytes.
Decompression is bounded by the expected raw size, so a hostile record cannot make us
allocate more than one chunk.
"""

from __future__ import annotations

import enum
import struct

import lz4.block
import numpy as np

from kvstore.errors import CompressionError, StoreConfigError

Segments = list[bytes | memoryview]
_PLANE_LEN = struct.Struct("<I")


class Codec(enum.StrEnum):
    NONE = "none"
    LZ4 = "lz4-plain"
    LZ4_PLANES = "lz4-planes"


def resolve_codec(option: str | None, itemsize: int) -> Codec:
    """Map the user option to a codec: "lz4" means byte planes for multi-byte dtypes."""
    if option in (None, "", "none"):
        return Codec.NONE
    if option == "lz4":
        return Codec.LZ4_PLANES if itemsize > 1 else Codec.LZ4
    try:
        return Codec(option)
    except ValueError:
        raise StoreConfigError(f"unknown compression {option!r}; use none or lz4") from None


def compress(codec: Codec, payload: memoryview, itemsize: int) -> Segments | None:
    """The compressed payload as segments to concatenate, or None if it would not shrink."""
    if codec is Codec.NONE:
        return None
    segments = encode_segments(codec, payload, itemsize)
    return segments if sum(len(s) for s in segments) < payload.nbytes else None


def encode_segments(codec: Codec, payload: memoryview, itemsize: int) -> Segments:
    """What `codec` makes of `payload`, even if it is larger (for measurements)."""
    if codec is Codec.LZ4:
        return [lz4.block.compress(payload, store_size=False)]
    if codec is Codec.LZ4_PLANES:
        return _compress_planes(payload, itemsize)
    return [payload]


def decompress_into(codec: Codec, data: memoryview, out: memoryview, itemsize: int) -> None:
    """Decompress `data` into `out` (exactly out.nbytes bytes) or raise CompressionError."""
    try:
        if codec is Codec.LZ4:
            _copy_exact(lz4.block.decompress(data, uncompressed_size=out.nbytes), out)
        elif codec is Codec.LZ4_PLANES:
            _decompress_planes(data, out, itemsize)
        else:
            raise CompressionError(f"codec {codec} has no decompressor")
    except (lz4.block.LZ4BlockError, ValueError, struct.error) as exc:
        raise CompressionError(f"{codec} payload does not decompress: {exc}") from None


def _compress_planes(payload: memoryview, itemsize: int) -> Segments:
    elements = np.frombuffer(payload, dtype=np.uint8).reshape(-1, itemsize)
    packed = lz4.block.compress(np.ascontiguousarray(elements[:, -1]), store_size=False)
    rest = np.ascontiguousarray(elements[:, :-1].T)
    return [_PLANE_LEN.pack(len(packed)), packed, memoryview(rest).cast("B")]


def _decompress_planes(data: memoryview, out: memoryview, itemsize: int) -> None:
    count = out.nbytes // itemsize
    (packed_len,) = _PLANE_LEN.unpack_from(data)
    start = _PLANE_LEN.size + packed_len
    if data.nbytes - start != (itemsize - 1) * count:
        raise CompressionError("byte-plane payload has the wrong size")
    top = lz4.block.decompress(data[_PLANE_LEN.size : start], uncompressed_size=count)
    if len(top) != count:
        raise CompressionError("most significant byte plane has the wrong size")
    elements = np.frombuffer(out, dtype=np.uint8).reshape(count, itemsize)
    elements[:, -1] = np.frombuffer(top, dtype=np.uint8)
    rest = np.frombuffer(data, dtype=np.uint8, offset=start).reshape(itemsize - 1, count)
    elements[:, :-1] = rest.T


def _copy_exact(data: bytes, out: memoryview) -> None:
    if len(data) != out.nbytes:
        raise CompressionError(f"decompressed {len(data)} bytes, expected {out.nbytes}")
    out[:] = data
