"""ChunkSpec: what one stored chunk looks like (fingerprint, shape, dtype, tokens)."""

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
    """The layout every record of a store is validated against.

    `shape` is the payload shape, for the engine `[blocks_per_chunk, num_layers, 2,
    block_size, num_kv_heads, head_dim]` (the output of kernels.gather_blocks);
    `fingerprint` the 32-byte model fingerprint digest (engine.hashing.ModelFingerprint).
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
        if not 1 <= len(shape) <= MAX_RANK or any(not 0 < d < 2**32 for d in shape):
            raise StoreConfigError(
                f"chunk shape must have 1..{MAX_RANK} positive dims, got {shape}"
            )
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

    @functools.cached_property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @functools.cached_property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    @property
    def dtype_code(self) -> int:
        return DTYPE_CODES[self.dtype]

    def check_tensor(self, tensor: torch.Tensor) -> None:
        """Raise ChunkSpecError unless `tensor` is a contiguous CPU chunk of this spec."""
        if (
            tensor.device.type != "cpu"
            or tensor.dtype != self.dtype
            or tuple(tensor.shape) != self.shape
            or not tensor.is_contiguous()
        ):
            raise ChunkSpecError(
                f"expected a contiguous cpu tensor {self.dtype} {list(self.shape)}, got "
                f"{tensor.device.type} {tensor.dtype} {list(tensor.shape)}"
                f"{'' if tensor.is_contiguous() else ' (non-contiguous)'}"
            )


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A flat, writable byte view of a contiguous CPU tensor (no copy)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy()).cast("B")
