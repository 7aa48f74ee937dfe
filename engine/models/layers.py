"""Building blocks of the decoder: RMSNorm, (fused) linear projections, the embedding.

On CPU a bf16 projection can run on a weight packed once into oneDNN's blocked layout
(`pack_weight`, `packed_linear`): `F.linear` reorders the plain weight on every call,
which at decode sizes costs about as much as the matmul itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kvkernels
from engine.models import fused as fused_ops


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 and cast back before the weight, exactly like transformers."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.ones(size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        norm = fused_ops.rms_norm if fused else kvkernels.rms_norm
        return norm(x, self.weight, self.eps)


PACK_BATCH_HINT = 16  # rows oneDNN picks the packed layout for; decode and mixed steps


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` `[out, in]` in oneDNN's blocked layout for `packed_linear`, or None where
    packing does not pay or is not supported: off CPU, other dtypes than bf16 (packed fp32
    is slower at one row), or a CPU without oneDNN bf16."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`x W^T (+ b)` with the weight from `pack_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Module):
    """`y = x W^T (+ b)`, optionally the concatenation of several checkpoint projections.

    `shards` maps a checkpoint projection name (e.g. "q_proj") to its rows in the fused
    weight, so the loader can copy each checkpoint tensor into place and one matmul
    replaces several small ones. Once loaded, `pack` may swap the weight for its packed
    form (then `weight` is None).
    """

    def __init__(
        self,
        in_features: int,
        shards: dict[str, int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.shards: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in shards.items():
            self.shards[name] = (offset, size)
            offset += size
        kwargs = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(offset, in_features, **kwargs), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(offset, **kwargs), requires_grad=False) if bias else None
        )
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return kvkernels.linear(x, self.weight, self.bias)

    def pack(self) -> bool:
        """Replace the weight by its packed form where that applies (`pack_weight`),
        freeing the plain one; whether it did."""
        if self.packed is None:
            self.packed = pack_weight(self.weight)
            if self.packed is not None:
                self.weight = None
        return self.packed is not None

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor `tensor` (of projection `shard`) into `weight` or `bias`."""
        offset, size = self.shards[shard]
        if self.packed is not None:
            raise ValueError(f"{shard}.{param}: the weight is packed already; load before packing")
        target = getattr(self, param)
        expected = (size, *target.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{shard}.{param}: shape {tuple(tensor.shape)}, expected {expected}")
        target.narrow(0, offset, size).copy_(tensor)


class Embedding(nn.Module):
    """Token embedding whose weight is filled by the loader (no random init at build time)."""

    def __init__(self, num: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(num, dim, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)
