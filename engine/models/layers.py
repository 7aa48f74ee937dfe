"""Building blocks of the decoder: RMSNorm, (fused) linear projections, the embedding."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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
        norm = fused_ops.rms_norm if fused else fused_ops.eager_rms_norm
        return norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """`y = x W^T (+ b)`, optionally the concatenation of several checkpoint projections.

    `shards` maps a checkpoint projection name (e.g. "q_proj") to its rows in the fused
    weight, so the loader can copy each checkpoint tensor into place and one matmul
    replaces several small ones.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load_shard(self, shard: str, param: str, tensor: torch.Tensor) -> None:
        """Copy checkpoint tensor `tensor` (of projection `shard`) into `weight` or `bias`."""
        offset, size = self.shards[shard]
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
