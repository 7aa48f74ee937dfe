"""Where each token of a blended region takes its KV from, and the names of blended blocks.

`reuse_sources` maps every region token to the stored KV of its segment (the segment
computed alone from position 0, kept in whole blocks of the device prefix cache) or to
nothing (computed in context): the last segment (the question), tokens past a
segment's last full block, tokens of blocks not found, and the prompt's last token are
computed.

`blended_block_hashes`: a blended request's blocks hold approximate KV, so they must
never be found by a request that did not blend the same way. The chain of block hashes
keeps the exact hashes for the blocks of the exact prefix hit and marks the first
block after it with the blend (ratio and segment starts); every later block, decode
blocks included (the scheduler extends the chain), chains from that mark. A request
without segments never computes these names, while the same blended request again
finds its own blocks as an ordinary prefix hit.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.hashing import hash_block, salt_extra

BLEND_MARK_VERSION = b"kvtier-blend/v3"  # v3: each segment's common error taken off its moved KV


@dataclass(frozen=True)
class ReuseSources:
    """Per region token: the slot of its stored KV (-1: compute it), the position shift
    that moves its key there (the start of its segment), and the index of that segment
    and the token's offset in it (-1 and 0 for a token computed)."""

    slots: list[int]
    shifts: list[int]
    segments: list[int]
    offsets: list[int]


def reuse_sources(
    bounds: Sequence[tuple[int, int]],
    region: tuple[int, int],
    block_size: int,
    stored_block: Callable[[int, int], int | None],
) -> ReuseSources:
    """Sources of the tokens at positions `region[0] .. region[1] - 1` of a prompt whose
    segments span `bounds`. `stored_block(segment, i)` is the device block holding the
    i-th block of that segment computed alone, or None."""
    start, end = region
    slots, shifts, segments, offsets = ([fill] * (end - start) for fill in (-1, 0, -1, 0))
    for index, (seg_start, seg_end) in enumerate(bounds[:-1]):
        full_end = seg_start + (seg_end - seg_start) // block_size * block_size
        first, last = max(seg_start, start), min(full_end, end)
        for block in range((first - seg_start) // block_size, -(-(last - seg_start) // block_size)):
            block_id = stored_block(index, block)
            if block_id is None:
                continue
            lo = max(first, seg_start + block * block_size)
            hi = min(last, seg_start + (block + 1) * block_size)
            for position in range(lo, hi):
                row, offset = position - start, position - seg_start
                slots[row] = block_id * block_size + offset % block_size
                shifts[row], segments[row], offsets[row] = seg_start, index, offset
    return ReuseSources(slots, shifts, segments, offsets)


def reusable_end(bounds: Sequence[tuple[int, int]], block_size: int) -> int:
    """The end of the prompt's last position that a blend can give a segment's stored KV:
    the last full block of the last segment before the question that has one; 0 if
    none has."""
    ends = [start + (end - start) // block_size * block_size
            for start, end in bounds[:-1] if end - start >= block_size]
    return max(ends, default=0)


def blend_mark(recompute_ratio: float, starts: Sequence[int]) -> bytes:
    """Extra hash bytes naming a blend: its version, ratio and segment starts."""
    return (BLEND_MARK_VERSION + struct.pack("<d", recompute_ratio)
            + struct.pack(f"<{len(starts)}I", *starts))


def blended_block_hashes(
    exact: Sequence[bytes], num_exact: int, token_ids: Sequence[int], block_size: int,
    seed: bytes, cache_salt: str | None, mark: bytes,
) -> list[bytes]:
    """The first `num_exact` exact hashes, then the marked chain over the rest of the
    full blocks of `token_ids` (see the module docstring)."""
    hashes = list(exact[:num_exact])
    for block in range(num_exact, len(token_ids) // block_size):
        parent = hashes[-1] if hashes else seed
        extra = (salt_extra(cache_salt) if block == 0 else b"") + (mark if block == num_exact else b"")
        hashes.append(hash_block(parent, token_ids[block * block_size : (block + 1) * block_size], extra))
    return hashes
