"""Segmented prompts: separator splitting, per-segment tokenization, and where each
token of a blended region takes its KV from."""

from __future__ import annotations

import pytest

from engine.blend.plan import blend_mark, blended_block_hashes, reuse_sources
from engine.blend.segments import (
    MAX_SEGMENTS,
    SegmentedTokens,
    Segments,
    SegmentsError,
    split_text,
    tokenize_segments,
)
from engine.hashing import BlockHasher


class CharTokenizer:
    """One token per character (its code point), with an optional BOS of 1."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]


def test_split_text_marks_boundaries_and_drops_the_separator():
    assert split_text("sys<S>doc one<S>question", "<S>").parts == ("sys", "doc one", "question")
    assert split_text("<S>a<S><S>b", "<S>").parts == ("a", "b")
    assert split_text("no marks here", "<S>") is None
    assert split_text("anything", None) is None
    with pytest.raises(SegmentsError):
        split_text("<S><S>", "<S>")


def test_each_segment_is_tokenized_alone():
    tokens = tokenize_segments(CharTokenizer().encode, Segments(["ab", "", "cd", [7, 8]]), add_special_tokens=True)
    assert list(tokens) == [1, 97, 98, 99, 100, 7, 8]
    assert tokens.starts == (0, 3, 5)
    assert tokens.bounds == [(0, 3), (3, 5), (5, 7)]
    assert len(tokens) == 7 and tokens[1:3] == [97, 98]
    chat = tokenize_segments(CharTokenizer().encode, Segments(["ab", "cd"]), add_special_tokens=False)
    assert list(chat) == [97, 98, 99, 100]


def test_bad_segments_are_refused():
    with pytest.raises(SegmentsError):
        Segments([])
    with pytest.raises(SegmentsError):
        Segments("a plain string")
    with pytest.raises(SegmentsError):
        Segments(["x"] * (MAX_SEGMENTS + 1))
    with pytest.raises(SegmentsError):
        tokenize_segments(CharTokenizer().encode, Segments(["", []]), add_special_tokens=False)
    with pytest.raises(SegmentsError):
        SegmentedTokens([1, 2, 3], [0, 2, 2])


def test_reuse_sources_cover_the_full_stored_blocks_of_every_segment_but_the_last():
    # segments: [0, 5) [5, 14) [14, 20); block size 4; the region starts at position 4
    bounds = [(0, 5), (5, 14), (14, 20)]
    stored = {(0, 0): 10, (0, 1): 11, (1, 0): 20, (1, 1): 21}  # segment 1's block 1 only partly needed

    sources = reuse_sources(bounds, (4, 20), 4, lambda seg, block: stored.get((seg, block)))
    # position 4 is past segment 0's full blocks; 5..12 are segment 1's two full blocks;
    # 13 is its partial block; the last segment is always computed
    assert sources.slots == [-1, 80, 81, 82, 83, 84, 85, 86, 87, -1, -1, -1, -1, -1, -1, -1]
    assert sources.shifts[1:9] == [5] * 8
    assert sources.segments[1:9] == [1] * 8 and sources.offsets[1:9] == list(range(8))

    missing = reuse_sources(bounds, (4, 20), 4, lambda seg, block: 20 if (seg, block) == (1, 0) else None)
    assert missing.slots[1:5] == [80, 81, 82, 83] and missing.slots[5:9] == [-1] * 4


def test_blended_block_names_keep_the_exact_prefix_and_mark_the_rest():
    hasher = BlockHasher(b"fingerprint", 4)
    tokens = list(range(3, 23))
    exact = hasher.hashes(tokens, "salt")
    mark = blend_mark(0.15, [0, 5, 14])
    named = blended_block_hashes(exact, 2, tokens, 4, hasher.seed, "salt", mark)
    assert named[:2] == exact[:2] and len(named) == len(exact)
    assert not set(named[2:]) & set(exact)
    assert blended_block_hashes(exact, 2, tokens, 4, hasher.seed, "salt", mark) == named
    other_ratio = blended_block_hashes(exact, 2, tokens, 4, hasher.seed, "salt", blend_mark(0.3, [0, 5, 14]))
    other_split = blended_block_hashes(exact, 2, tokens, 4, hasher.seed, "salt", blend_mark(0.15, [0, 9, 14]))
    assert other_ratio[2] != named[2] and other_split[2] != named[2]
    from_start = blended_block_hashes(exact, 0, tokens, 4, hasher.seed, "salt", mark)
    assert from_start[0] != exact[0] and from_start[0] != named[0]
    # the scheduler extends the chain block by block from its last hash
    longer = tokens + list(range(23, 27))
    extended = list(named)
    hasher.extend(extended, longer, "salt")
    assert extended[:-1] == named and extended[-1] not in hasher.hashes(longer, "salt")
