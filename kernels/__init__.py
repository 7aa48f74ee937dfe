"""Paged attention, KV write and block gather/scatter behind one dispatch.

`auto` (the default) runs the Triton kernels on CUDA tensors and the torch reference
everywhere else. `set_backend` / `use_backend` force one (tests force `triton` on CPU
tensors under `TRITON_INTERPRET=1`). Triton is imported only when a Triton kernel runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch

from kernels import reference
from kernels.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "gather_blocks",
    "get_backend",
    "paged_attention",
    "scatter_blocks",
    "set_backend",
    "use_backend",
    "write_kv",
]

BACKENDS = ("auto", "torch", "triton")
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose "auto" (Triton on CUDA tensors, torch elsewhere), "torch" or "triton"."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown kernel backend {name!r}; expected one of {BACKENDS}")
    _backend = name


def get_backend() -> str:
    return _backend


@contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force a backend inside a `with` block, restoring the previous one after."""
    previous = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(previous)


_triton_modules: dict[str, ModuleType] = {}


def _impl(tensor: torch.Tensor, triton_module: str) -> ModuleType:
    """The torch reference, or the Triton module (imported on first use) if it applies."""
    if _backend == "torch" or (_backend == "auto" and not tensor.is_cuda):
        return reference
    module = _triton_modules.get(triton_module)
    if module is None:
        module = _triton_modules[triton_module] = importlib.import_module(f"kernels.{triton_module}")
    return module


def write_kv(
    kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write key/value `[num_tokens, kv_heads, head_dim]` into `kv_layer`
    (`[num_blocks, 2, block_size, kv_heads, head_dim]`) at `slot_mapping`; slot < 0 skipped."""
    _impl(kv_layer, "triton_kv_ops").write_kv(kv_layer, key, value, slot_mapping)


def paged_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal varlen paged attention (GQA, fp32 accumulation); `[num_tokens, heads, head_dim]`."""
    return _impl(kv_layer, "triton_attention").paged_attention(query, kv_layer, meta, scale)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """`out[j] = kv_cache[block_ids[j]]` for the whole block (all layers, K and V)."""
    _impl(kv_cache, "triton_kv_ops").gather_blocks(kv_cache, block_ids, out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """`kv_cache[block_ids[j]] = src[j]` for the whole block (all layers, K and V)."""
    _impl(kv_cache, "triton_kv_ops").scatter_blocks(kv_cache, block_ids, src)
