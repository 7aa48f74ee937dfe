"""Blending: RAG prompts whose documents come in any order reuse each document's KV.

A prompt marked as segments (system prompt, documents, question; `segments.py`) has
each segment's KV stored as computed alone from position 0, under the ordinary block
hashes of the segment's own tokens: in the device prefix cache and, through the
connector, in every store tier. A blended prefill moves each stored segment's keys to
their positions in the prompt and recomputes only the tokens whose KV deviates most
from a full prefill (`forward.py`, CacheBlend's selection), the segments without
stored KV and the question.

- `segments.py`: `Segments` (what a client passes), `SegmentedTokens` (token ids that
  know their segment starts), separator splitting and per-segment tokenization.
- `plan.py`: which stored block feeds each token of the blended region; the names
  (block hashes) of blended blocks, apart from exact ones.
- `forward.py`: the blended forward, on the model's own modules.
- `blender.py`: the engine side: segment prefills, admission, handoff, counters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.blend.segments import (
    SegmentedTokens,
    Segments,
    SegmentsError,
    split_text,
    tokenize_segments,
)

if TYPE_CHECKING:
    from engine.blend.blender import Blender

__all__ = ["Blender", "SegmentedTokens", "Segments", "SegmentsError", "split_text", "tokenize_segments"]


def __getattr__(name: str) -> object:
    """`Blender` (torch) is imported when first asked for: segments alone are torch-free,
    and what only parses or tokenizes prompts (`kvtier router`) never loads torch."""
    if name == "Blender":
        from engine.blend.blender import Blender

        return Blender
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
