"""The elementwise chains of large steps, fused into one pass each by torch.compile (CPU).

RMSNorm (cast to fp32, square, mean, rsqrt, scale, cast back, weight), rotary (four
products and two sums over the halves of each head) and SiLU-and-mul are memory-bound
chains of eager ops, each op a pass over the step's activations: a 2,048-token chunk's
activations do not stay in cache between them. Inductor turns each chain into one loop.
Small steps (decode) keep the eager ops, where a compiled call's guard checks cost more
than the passes they would save.

A function that fails to compile (no C++ compiler, say) falls back to its eager form for
the rest of the process, with one warning; the results are the same either way up to
fp32 rounding order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Steps of at least this many tokens run the fused forms.
MIN_FUSED_TOKENS = 256


class _Fused:
    """`eager` compiled on first use; eager again for good if compiling fails."""

    def __init__(self, eager: Callable[..., torch.Tensor]) -> None:
        self.eager = eager
        self.compiled: Callable[..., torch.Tensor] | None = None
        self.failed = False

    def __call__(self, *args: object) -> torch.Tensor:
        if self.failed:
            return self.eager(*args)
        if self.compiled is None:
            self.compiled = torch.compile(self.eager, dynamic=True)
        try:
            return self.compiled(*args)
        except Exception as exc:  # a compile failure: the eager form computes the same
            self.failed = True
            logger.warning("torch.compile of %s failed, using eager ops: %s", self.eager.__name__, exc)
            return self.eager(*args)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype) * weight


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


rms_norm = _Fused(_rms_norm)
rotary = _Fused(_rotary)
silu_and_mul = _Fused(_silu_and_mul)


def warm_up(model: torch.nn.Module) -> None:
    """Compile the fused forms for `model`'s dtype and shapes now (seconds), so that the
    first large step does not pay for it."""
    args = model.args
    weight = next(model.parameters())
    like = {"dtype": weight.dtype, "device": weight.device}
    tokens = MIN_FUSED_TOKENS
    with torch.inference_mode():
        rms_norm(torch.zeros(tokens, args.hidden_size, **like), torch.ones(args.hidden_size, **like), 1e-6)
        if args.qk_norm:
            heads = torch.zeros(tokens, args.num_heads, args.head_dim, **like)
            rms_norm(heads, torch.ones(args.head_dim, **like), 1e-6)
        half = torch.zeros(tokens, 1, args.head_dim // 2, **like)
        rotary(torch.zeros(tokens, args.num_heads + args.num_kv_heads, args.head_dim, **like), half, half)
        silu_and_mul(torch.zeros(tokens, 2 * args.intermediate_size, **like))
