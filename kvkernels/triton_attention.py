"""Triton paged attention for the engine's mixed varlen batches.

One launch covers prefill chunks and single-token decodes. A program owns one KV head,
one sequence and a tile of its new tokens; the query heads that share the KV head are
packed into the tile's rows (`BLOCK_Q` tokens x `GROUP_PAD` heads), so a decode still
fills a tensor-core-sized tile. Keys and values are read through the block table one
`BLOCK_N` tile at a time, with an online softmax in fp32.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvkernels.metadata import AttentionMetadata

# The interpreter computes bf16/fp16 dots wrongly; there the operands go through fp32.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    kv_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kv_block,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_first = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_first
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    cached = seq_len - q_len

    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    token = q_tile * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (token < q_len) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    q_off = (q_first + token)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q = q.to(tl.float32) if UPCAST else q.to(kv_ptr.dtype.element_ty)
    q_pos = cached + token

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, cached + (q_tile + 1) * BLOCK_Q)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(0, kv_end, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_end
        block = tl.load(table + k_pos // PAGE, mask=k_ok, other=0).to(tl.int64)
        base = block * stride_kv_block + (k_pos % PAGE) * stride_kv_slot + kv_head * stride_kv_head
        kv_off = base[:, None] + dims[None, :]
        kv_mask = k_ok[:, None] & dim_ok[None, :]
        k = tl.load(kv_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(kv_ptr + stride_kv_kind + kv_off, mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / l_i[:, None]
    o_off = (q_first + token)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
    tl.store(out_ptr + o_off, out, mask=row_ok[:, None] & dim_ok[None, :])


def paged_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Triton version of `kvkernels.reference.paged_attention` (same contract)."""
    num_tokens, heads, head_dim = query.shape
    page, kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    group = heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = _tokens_per_tile(meta.max_query_len, group_pad)
    query = query if query.stride(2) == 1 else query.contiguous()
    out = query.new_empty(query.shape)
    if num_tokens == 0:
        return out
    assert kv_layer.stride(4) == 1, "the cache's head_dim must be contiguous"
    upcast = _INTERPRET or kv_layer.dtype == torch.float32
    grid = (meta.num_seqs, triton.cdiv(meta.max_query_len, block_q), kv_heads)
    _paged_attention_kernel[grid](
        query,
        kv_layer,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *kv_layer.stride()[:4],
        meta.block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=16 if _INTERPRET else 64,
        PAGE=page,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        UPCAST=upcast,
        # fp32 operands must not be rounded to tf32; other dtypes keep Triton's default.
        DOT_PRECISION="ieee" if upcast else "tf32",
    )
    return out


def _tokens_per_tile(max_query_len: int, group_pad: int) -> int:
    """Query tokens per program: enough rows (>= 16) for `tl.dot`, at most 64 rows for
    prefill, and no wasted tokens for decode-only batches beyond the 16-row minimum."""
    rows = 16 if max_query_len <= 16 // group_pad or _INTERPRET else 64
    return max(1, rows // group_pad)
