"""Random paged varlen batches and a naive fp32 attention oracle for the kernel tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvkernels.metadata import AttentionMetadata


@dataclass
class PagedBatch:
    query: torch.Tensor  # [num_tokens, heads, head_dim]
    kv_layer: torch.Tensor  # [num_blocks, 2, block_size, kv_heads, head_dim]
    meta: AttentionMetadata
    keys: list[torch.Tensor]  # per sequence, [seq_len, kv_heads, head_dim]
    values: list[torch.Tensor]


def make_batch(
    shapes: list[tuple[int, int]],
    *,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    spare_blocks: int = 3,
    seed: int = 0,
) -> PagedBatch:
    """`shapes` lists (query_len, seq_len) per sequence. Blocks are handed out in a
    shuffled order with unused blocks (holes) left between them; every unused slot holds
    large values, so reading one changes the result."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for _, seq_len in shapes]
    num_blocks = sum(needed) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    kv_layer = torch.full((num_blocks, 2, block_size, kv_heads, head_dim), 1e4, dtype=dtype)
    tables = torch.zeros(len(shapes), max(needed), dtype=torch.int32)
    keys, values, slots = [], [], []
    for i, ((q_len, seq_len), n) in enumerate(zip(shapes, needed, strict=True)):
        blocks = torch.tensor([order.pop() for _ in range(n)])
        tables[i, :n] = blocks
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(seq_len)
        seq_slots = blocks[pos // block_size] * block_size + pos % block_size
        kv_layer[seq_slots // block_size, 0, seq_slots % block_size] = k
        kv_layer[seq_slots // block_size, 1, seq_slots % block_size] = v
        keys.append(k)
        values.append(v)
        slots.append(seq_slots[seq_len - q_len :])
    q_lens = [q for q, _ in shapes]
    seq_lens = [s for _, s in shapes]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(
            [0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        slot_mapping=torch.cat(slots).long(),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(query, kv_layer, meta, keys, values)


def naive_attention(batch: PagedBatch, scale: float) -> torch.Tensor:
    """fp32 softmax attention per sequence from the dense K/V, bottom-right causal."""
    outs, start = [], 0
    heads = batch.query.shape[1]
    for (k, v), q_len in zip(
        zip(batch.keys, batch.values, strict=True), batch.meta.query_lens_cpu, strict=True
    ):
        q = batch.query[start : start + q_len].float()
        start += q_len
        group = heads // k.shape[1]
        k = k.float().repeat_interleave(group, dim=1)
        v = v.float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        ctx = k.shape[0]
        allowed = torch.ones(q_len, ctx, dtype=torch.bool).tril(ctx - q_len)
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, v))
    return torch.cat(outs)
