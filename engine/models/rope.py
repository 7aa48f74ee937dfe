"""Rotary position embedding: inverse frequencies per rope type, and a cos/sin cache.

The frequencies follow transformers' definitions operation by operation, so that cos/sin
are bit-identical to the reference in fp32. The cache holds one row per position; the
forward indexes it by `positions`, so tokens of any request at any offset share it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.models.args import UnsupportedArchitectureError


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (theta**exponents)


def _default(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params["rope_theta"], dim), 1.0


def _linear(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(params["rope_theta"], dim) / params["factor"], 1.0


def _llama3(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth ramp between."""
    inv_freq = _base_inv_freq(params["rope_theta"], dim)
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_len = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_range(params: dict[str, Any], dim: int) -> tuple[float, float]:
    theta = params["rope_theta"]
    old_len = params["original_max_position_embeddings"]

    def dim_for(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = dim_for(params.get("beta_fast") or 32)
    high = dim_for(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def _yarn(params: dict[str, Any], dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, scale cos/sin by mscale."""
    factor = params["factor"]
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    pos_freqs = params["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    low, high = _yarn_correction_range(params, dim)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp
    return interpolated * (1 - keep) + extrapolated * keep, float(attention_factor)


ROPE_TYPES: dict[str, Callable[[dict[str, Any], int], tuple[torch.Tensor, float]]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def inverse_frequencies(params: dict[str, Any], head_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] fp32, cos/sin scaling) for a standardized rope dict."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitectureError("partial_rotary_factor != 1 is not supported")
    return ROPE_TYPES[rope_type](params, head_dim)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary (first half / second half of each head) from a cos/sin cache."""

    def __init__(
        self,
        params: dict[str, Any],
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        inv_freq, scaling = inverse_frequencies(params, head_dim)
        freqs = torch.arange(max_positions).float()[:, None] * inv_freq[None, :]
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", (freqs.cos() * scaling).to(dtype).to(device), persistent=False)
        self.register_buffer("sin", (freqs.sin() * scaling).to(dtype).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[T, 1, head_dim // 2]`, ready to broadcast over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, head_dim]` into a new contiguous tensor; the same products and
    sums as transformers' rotate_half form, written into the halves of the result."""
    x1, x2 = x.chunk(2, dim=-1)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out1, out2 = out.chunk(2, dim=-1)
    torch.mul(x1, cos, out=out1).sub_(x2 * sin)
    torch.mul(x2, cos, out=out2).add_(x1 * sin)
    return out
