"""ChunkSpec: the layout every record of a store holds (fingerprint, block shape, dtype)."""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch

from kvstore.errors import ChunkSpecError, StoreConfigError

FINGERPRINT_BYTES = 32
MAX_RANK = 8
DTYPE_CODES: dict[torch.dtype, int] = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    resolved = DTYPE_NAMES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPE_CODES:
        raise StoreConfigError(f"unsupported KV dtype {dtype!r}; use float32, float16 or bfloat16")
    return resolved


@dataclass(frozen=True)
class ChunkSpec:
    """The layout a store's records are validated against.

    `shape` is the payload of a full record, for the engine `[blocks_per_chunk,
    num_layers, 2, block_size, num_kv_heads, head_dim]`: `blocks_per_chunk` blocks, each
    of `block_shape` (block-major, as the device cache holds them). A record holds 1 to
    `blocks_per_chunk` blocks. `fingerprint` is the 32-byte model fingerprint digest
    (engine.hashing.ModelFingerprint).
    """

    fingerprint: bytes
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunk_tokens: int

    def __post_init__(self) -> None:
        if sys.byteorder != "little":
            raise StoreConfigError("records are little-endian; big-endian hosts are not supported")
        if not isinstance(self.fingerprint, bytes) or len(self.fingerprint) != FINGERPRINT_BYTES:
            raise StoreConfigError(f"fingerprint must be {FINGERPRINT_BYTES} bytes")
        shape = tuple(int(d) for d in self.shape)
        if not 2 <= len(shape) <= MAX_RANK + 1 or any(not 0 < d < 2**32 for d in shape):
            raise StoreConfigError(
                f"chunk shape must be [blocks, *block shape] with 1..{MAX_RANK} positive "
                f"block dims, got {shape}"
            )
        if shape[0] >= 2**16:
            raise StoreConfigError(f"at most {2**16 - 1} blocks per chunk, got {shape[0]}")
        if self.chunk_tokens <= 0:
            raise StoreConfigError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    @classmethod
    def for_kv_layout(
        cls,
        fingerprint: bytes,
        *,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str,
        chunk_tokens: int = 256,
    ) -> ChunkSpec:
        """The spec of the engine's block-major KV layout (docs/ARCHITECTURE.md)."""
        if chunk_tokens % block_size:
            raise StoreConfigError(
                f"chunk_tokens {chunk_tokens} is not a multiple of block_size {block_size}"
            )
        shape = (chunk_tokens // block_size, num_layers, 2, block_size, num_kv_heads, head_dim)
        return cls(fingerprint, shape, as_dtype(dtype), chunk_tokens)

    @property
    def blocks_per_chunk(self) -> int:
        return self.shape[0]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @functools.cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @functools.cached_property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * self.itemsize

    @functools.cached_property
    def nbytes(self) -> int:
        """Payload bytes of a full record."""
        return self.blocks_per_chunk * self.block_bytes

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    def check_tensor(self, tensor: torch.Tensor) -> int:
        """The number of blocks of `tensor`, a contiguous CPU tensor of 1 to
        `blocks_per_chunk` blocks of this spec; ChunkSpecError otherwise."""
        shape = tuple(tensor.shape)
        if (
            tensor.device.type != "cpu"
            or tensor.dtype != self.dtype
            or shape[1:] != self.block_shape
            or not 1 <= (shape[0] if shape else 0) <= self.blocks_per_chunk
            or not tensor.is_contiguous()
        ):
            raise ChunkSpecError(
                f"expected a contiguous cpu tensor {self.dtype} [1..{self.blocks_per_chunk}, "
                f"{', '.join(map(str, self.block_shape))}], got {tensor.device.type} {tensor.dtype} "
                f"{list(shape)}{'' if tensor.is_contiguous() else ' (non-contiguous)'}"
            )
        return shape[0]


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat, writable byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)` for contiguous CPU tensors of the same bytes, as one memcpy: torch
    splits a copy over its intra-op threads, and on a busy machine waking them costs
    many times the copy of one record."""
    tensor_bytes(dst)[:] = tensor_bytes(src)
