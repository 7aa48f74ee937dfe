"""Prompts marked as segments: the system prompt, each retrieved document, the question.

A client marks segments either explicitly (`Segments([...])`, the completions API's
`segments` field) or with a separator string inside the text (`--kv-blend-separator`,
or the request's `kv_blend_separator`), as LMCache does. The separator only marks the
boundaries: it is not part of the prompt the model sees.

Each text segment is tokenized on its own, so that a document yields the same tokens
wherever it appears (tokenizing the joined text would merge tokens across boundaries,
and the document's stored KV would no longer match). `SegmentedTokens` is the result:
a sequence of token ids (usable wherever token ids are) that also knows where each
segment starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import overload

MAX_SEGMENTS = 64


class SegmentsError(ValueError):
    """A segmented prompt that cannot be used (empty, too many segments, mixed kinds)."""


@dataclass(frozen=True)
class Segments:
    """A prompt given as its segments, in order; each is text or token ids. The last
    segment (the question) is always computed; the others may reuse stored KV."""

    parts: tuple[str | tuple[int, ...], ...]

    def __init__(self, parts: Sequence[str | Sequence[int]]) -> None:
        if isinstance(parts, str) or not parts:
            raise SegmentsError("segments must be a non-empty list of texts or token-id lists")
        if len(parts) > MAX_SEGMENTS:
            raise SegmentsError(f"at most {MAX_SEGMENTS} segments, got {len(parts)}")
        kept = tuple(p if isinstance(p, str) else tuple(p) for p in parts)
        object.__setattr__(self, "parts", kept)


class SegmentedTokens(Sequence[int]):
    """Token ids of a segmented prompt; `starts[i]` is where segment i begins."""

    def __init__(self, token_ids: Sequence[int], starts: Sequence[int]) -> None:
        self.token_ids = list(token_ids)
        self.starts = tuple(starts)
        if not self.token_ids or not self.starts or self.starts[0] != 0:
            raise SegmentsError("a segmented prompt needs tokens, its first segment starting at 0")
        if any(b <= a for a, b in zip(self.starts, (*self.starts[1:], len(self.token_ids)), strict=True)):
            raise SegmentsError("segments must be non-empty and in order")

    @property
    def bounds(self) -> list[tuple[int, int]]:
        """(start, end) of every segment."""
        ends = (*self.starts[1:], len(self.token_ids))
        return list(zip(self.starts, ends, strict=True))

    def __len__(self) -> int:
        return len(self.token_ids)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        return self.token_ids[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.token_ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SegmentedTokens):
            return self.token_ids == other.token_ids and self.starts == other.starts
        return NotImplemented

    __hash__ = None  # mutable token list, like list

    def __repr__(self) -> str:
        return f"SegmentedTokens({len(self.token_ids)} tokens, starts={list(self.starts)})"


def split_text(text: str, separator: str | None) -> Segments | None:
    """The segments `separator` marks in `text`; None when it marks none."""
    if not separator or separator not in text:
        return None
    parts = [part for part in text.split(separator) if part]
    if not parts:
        raise SegmentsError("the prompt holds nothing but segment separators")
    return Segments(parts)


def tokenize_segments(
    encode: Callable[[str, bool], list[int]], segments: Segments, add_special_tokens: bool
) -> SegmentedTokens:
    """Tokenize each text segment on its own with `encode(text, add_special_tokens)`
    (special tokens, such as a BOS, only before the first when `add_special_tokens`);
    token-id segments are kept. Empty segments are dropped."""
    token_ids: list[int] = []
    starts: list[int] = []
    for part in segments.parts:
        if isinstance(part, str):
            first = add_special_tokens and not token_ids
            ids = list(encode(part, first))
        else:
            ids = list(part)
        if ids:
            starts.append(len(token_ids))
            token_ids += ids
    if not token_ids:
        raise SegmentsError("the segments hold no tokens")
    return SegmentedTokens(token_ids, starts)
