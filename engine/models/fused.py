"""The decoder's elementwise chains: their eager forms, and each fused into one pass by
torch.compile for large CPU steps.

RMSNorm (cast to fp32, square, mean, rsqrt, scale, cast back, weight), rotary (four
products and two sums over the halves of each head) and SiLU-and-mul are memory-bound
chains of eager ops, each op a pass over the step's activations: a 2,048-token chunk's
activations do not stay in cache between them. Inductor turns each chain into one loop.
Small steps (decode) keep the eager ops, where a compiled call's guard checks cost more
than the passes they would save (their RMSNorm is the one-pass C++ kernel of
`kvkernels.rms_norm` where it builds).

RMSNorm is compiled from the torch reference's form (`kvkernels.reference.rms_norm`),
SiLU-and-mul from its eager form here, which the unfused path runs. Rotary has a form of
its own: the eager `rope.apply_rotary` writes into the halves of its result with `out=`,
which Dynamo cannot trace.

A function that fails to compile (no C++ compiler, say) falls back to its eager form for
the rest of the process, with one warning; the results are the same either way up to
rounding order.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvkernels import reference

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


def eager_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up for the fused `[..., 2 * intermediate]` gate/up projection output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`rope.apply_rotary`'s products and sums, without `out=`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


rms_norm = _Fused(reference.rms_norm)
rotary = _Fused(_rotary)
silu_and_mul = _Fused(eager_silu_and_mul)
