"""Paged attention, KV write, RMSNorm, small projections and block gather/scatter behind
one dispatch.

`auto` (the default) runs the Triton kernels on CUDA tensors, the C++ kernels of
`kvkernels/cpu.py` on CPU tensors (where they build; the torch reference otherwise) and the
torch reference for what neither has. `set_backend` / `use_backend` force one (tests force
`triton` on CPU tensors under `TRITON_INTERPRET=1`, and `torch` or `cpu` to compare the
two). Triton is imported only when a Triton kernel runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F

from kvkernels import cpu, reference
from kvkernels.metadata import AttentionMetadata

__all__ = [
    "AttentionMetadata",
    "CpuKernelsUnavailableError",
    "apply_token_bitmask",
    "copy_runs",
    "gather_blocks",
    "get_backend",
    "linear",
    "paged_attention",
    "rms_norm",
    "scatter_blocks",
    "set_backend",
    "use_backend",
    "write_kv",
]

BACKENDS = ("auto", "torch", "triton", "cpu")
_backend = "auto"


def set_backend(name: str) -> None:
    """Choose "auto" (Triton on CUDA tensors, C++ on CPU ones), "torch", "triton" or "cpu"
    (the C++ kernels, which must build: `CpuKernelsUnavailableError` if they did not)."""
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


class CpuKernelsUnavailableError(RuntimeError):
    """The `cpu` backend was asked for, and its C++ kernels did not build."""


def _runs_cpu_kernels(tensor: torch.Tensor) -> bool:
    """Whether the C++ CPU kernels serve `tensor` under the current backend."""
    if _backend == "cpu":
        if not cpu.available():
            raise CpuKernelsUnavailableError("the C++ CPU kernels did not build (see the warning logged)")
        return True
    return _backend == "auto" and tensor.device.type == "cpu" and cpu.available()


def _impl(tensor: torch.Tensor, triton_module: str) -> ModuleType:
    """The module that runs this kernel on `tensor`: the C++ CPU kernels, the torch
    reference, or the Triton module (imported on first use)."""
    if _runs_cpu_kernels(tensor):
        return cpu
    if _backend == "torch" or (_backend == "auto" and not tensor.is_cuda):
        return reference
    module = _triton_modules.get(triton_module)
    if module is None:
        module = _triton_modules[triton_module] = importlib.import_module(f"kvkernels.{triton_module}")
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32, rounded to x's dtype before the weight's scale, as transformers
    computes it (the Triton backend has none: the reference runs there)."""
    return (cpu if _runs_cpu_kernels(x) else reference).rms_norm(x, weight, eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x W^T (+ b)`. A decode step's few fp32 rows run on the C++ kernel, which streams the
    weight once at the memory bandwidth (batch-1 decode is a pass over every weight);
    everything else is `F.linear`."""
    if (x.dim() == 2 and x.shape[0] <= cpu.SKINNY_ROWS and x.dtype == torch.float32
            and weight.dtype == torch.float32 and _runs_cpu_kernels(weight)):
        return cpu.skinny_linear(x, weight.contiguous(), bias)
    return F.linear(x, weight, bias)


def copy_runs(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """`dsts[i] = srcs[i]` for contiguous CPU tensors of equal sizes (host slots and
    device blocks on a CPU engine), the whole batch spread over torch's threads. For the
    engine thread: from a thread of its own, a torch thread team of its own would
    oversubscribe the cores (the store's I/O threads copy with `kvstore.host_copy`)."""
    (cpu if _runs_cpu_kernels(dsts[0]) else reference).copy_runs(dsts, srcs)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs' masks: `logits[rows[i], t] = -inf` where bit t of `bitmask[i]`
    (int32 words, little-endian bit order) is clear, and past the bitmask's width."""
    (cpu if _runs_cpu_kernels(logits) else reference).apply_token_bitmask(logits, bitmask, rows)


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """`out[j] = kv_cache[block_ids[j]]` for the whole block (all layers, K and V)."""
    _block_copies(kv_cache).gather_blocks(kv_cache, block_ids, out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """`kv_cache[block_ids[j]] = src[j]` for the whole block (all layers, K and V)."""
    _block_copies(kv_cache).scatter_blocks(kv_cache, block_ids, src)


def _block_copies(kv_cache: torch.Tensor) -> ModuleType:
    """Whole-block copies are one index_select / index_copy_ on CPU: the reference's."""
    module = _impl(kv_cache, "triton_kv_ops")
    return reference if module is cpu else module
