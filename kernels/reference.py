"""Torch implementations of the kernel contracts: what the CPU engine runs, and the
oracle the Triton kernels are tested against.

Each sequence with several new tokens (a prefill chunk) is computed on its own, in row
tiles of explicit fp32 QK^T + softmax that skip the masked upper triangle. All
single-token decodes of a step share one padded SDPA call, so a 32-request decode step
is one call, not 32. Host-side lengths (`meta.*_cpu`) drive the loops, so nothing here
syncs a device. The padded call reads slots past a sequence's length (stale KV of freed
blocks); `write_kv` stores only finite values into the zero-initialised cache (and the
engine zeroes what a forward that raised left behind), so the length mask alone keeps
them out of every output, as the Triton kernel's masked loads do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata


def write_kv(
    kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store key/value `[num_tokens, kv_heads, head_dim]` at their slots; slot < 0 is skipped.

    NaN and inf are stored as 0: `_decode_batch` reads slots past each sequence's end
    (stale KV of a block's earlier owner) and relies on every slot of the
    zero-initialised cache being finite, since a NaN or inf there would survive the
    length mask. A request whose own KV overflows is wrong either way; this keeps it from
    spoiling the requests that later reuse its blocks (zeroing the padding per step
    instead cost more than the attention itself: 17 vs 6 ms for 32 bf16 sequences of
    1,280 tokens on one core)."""
    block_size = kv_layer.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping[valid]
    blocks, offsets = slots // block_size, slots % block_size
    kv_layer[blocks, 0, offsets] = _finite(key[valid].to(kv_layer.dtype))
    kv_layer[blocks, 1, offsets] = _finite(value[valid].to(kv_layer.dtype))


def _finite(copy: torch.Tensor) -> torch.Tensor:
    """NaN and inf as 0, in place: `copy` is the fresh tensor boolean indexing made."""
    return copy.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)


def paged_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal varlen attention over the paged cache; returns `[num_tokens, heads, head_dim]`."""
    out = query.new_empty(query.shape)
    starts = _prefix_sums(meta.query_lens_cpu)
    decodes = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
    if len(decodes) > 1:
        _decode_batch(query, kv_layer, meta, scale, decodes, [starts[i] for i in decodes], out)
    batched = set(decodes) if len(decodes) > 1 else set()
    for i, q_len in enumerate(meta.query_lens_cpu):
        if i in batched or q_len == 0:
            continue
        rows = slice(starts[i], starts[i] + q_len)
        out[rows] = _sequence_attention(query[rows], kv_layer, meta, i, scale)
    return out


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """Copy blocks `block_ids` of the block-major cache into `out` (record layout)."""
    torch.index_select(kv_cache, 0, block_ids, out=out)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """Copy `src` (record layout) into blocks `block_ids` of the block-major cache."""
    kv_cache.index_copy_(0, block_ids, src.to(kv_cache.dtype))


def _prefix_sums(lengths: list[int]) -> list[int]:
    starts, total = [], 0
    for n in lengths:
        starts.append(total)
        total += n
    return starts


def _gather_context(
    kv_layer: torch.Tensor, block_ids: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of blocks `block_ids` (`[..., nb]`) as `[..., kv_heads, length, head_dim]` views.

    K and V are gathered separately so that the block and slot dims stay mergeable and
    the result needs no second copy."""
    shape = (*block_ids.shape[:-1], -1, *kv_layer.shape[3:])  # [..., nb * B, KH, D]
    flat_ids = block_ids.reshape(-1)
    k = kv_layer[:, 0].index_select(0, flat_ids).view(shape)[..., :length, :, :]
    v = kv_layer[:, 1].index_select(0, flat_ids).view(shape)[..., :length, :, :]
    return k.transpose(-2, -3), v.transpose(-2, -3)


def _sequence_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, i: int, scale: float
) -> torch.Tensor:
    """Sequence `i`'s new tokens `q` (`[q_len, H, D]`) against its whole context."""
    ctx_len = meta.seq_lens_cpu[i]
    num_blocks = -(-ctx_len // kv_layer.shape[2])
    k, v = _gather_context(kv_layer, meta.block_tables[i, :num_blocks].long(), ctx_len)
    return _causal_attention(q, k, v, scale)


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """Bottom-right causal attention of `q` `[Lq, H, D]` over `k`/`v` `[KH, L, D]`.

    Explicit fp32 QK^T + softmax over row tiles, each tile only against the keys it can
    see: on CPU this is several times faster than SDPA's flash kernel, which does not
    skip the masked upper triangle. P is cast to the value dtype for P @ V (fp32
    accumulation inside the matmul), as flash attention kernels do."""
    q_len, heads, head_dim = q.shape
    kv_heads, ctx_len = k.shape[0], k.shape[1]
    group = heads // kv_heads
    tile = _row_tile(heads, ctx_len)
    qg = q.permute(1, 0, 2).reshape(kv_heads, group, q_len, head_dim)
    k32 = k.float()
    v = v.to(q.dtype)
    out = torch.empty(kv_heads, group, q_len, head_dim, dtype=q.dtype, device=q.device)
    for first in range(0, q_len, tile):
        rows = min(tile, q_len - first)
        visible = ctx_len - q_len + first + rows
        qt = qg[:, :, first : first + rows].float().reshape(kv_heads, group * rows, head_dim)
        scores = torch.matmul(qt, k32[:, :visible].transpose(1, 2)).mul_(scale)
        scores = scores.view(kv_heads, group, rows, visible)
        diagonal = torch.ones(rows, rows, dtype=torch.bool, device=q.device).triu_(1)
        scores[..., visible - rows :].masked_fill_(diagonal, float("-inf"))
        probs = scores.softmax(-1).to(v.dtype).view(kv_heads, group * rows, visible)
        tile_out = torch.matmul(probs, v[:, :visible]).view(kv_heads, group, rows, head_dim)
        out[:, :, first : first + rows] = tile_out
    return out.view(heads, q_len, head_dim).transpose(0, 1)


def _row_tile(heads: int, ctx_len: int) -> int:
    """Query rows per tile: about 2M fp32 scores, between 16 and 128 rows."""
    return max(16, min(128, (1 << 21) // (heads * ctx_len)))


def _decode_batch(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    seqs: list[int],
    seq_rows: list[int],
    out: torch.Tensor,
) -> None:
    """All single-token sequences in one padded SDPA call with a length mask.

    The query heads sharing a KV head are folded into SDPA's query-length dim
    (`[S, KH, group, D]`); that is ~10x faster on CPU than `enable_gqa` with 1 row."""
    lens = [meta.seq_lens_cpu[i] for i in seqs]
    max_len = max(lens)
    num_blocks = -(-max_len // kv_layer.shape[2])
    device = query.device
    rows = torch.tensor(seq_rows, device=device)
    tables = meta.block_tables[torch.tensor(seqs, device=device), :num_blocks].long()
    k, v = _gather_context(kv_layer, tables, max_len)  # [S, KH, L, D]
    kv_heads, head_dim = k.shape[1], k.shape[3]
    q = query.index_select(0, rows).view(len(seqs), kv_heads, -1, head_dim)
    # Past each sequence's end the gathered slots hold stale but finite KV (see
    # write_kv), so the length mask alone keeps them out.
    mask = torch.arange(max_len, device=device) < torch.tensor(lens, device=device)[:, None]
    res = F.scaled_dot_product_attention(
        q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask[:, None, None, :], scale=scale
    )
    out.index_copy_(0, rows, res.reshape(len(seqs), -1, head_dim))
