"""Triton KV write (slot mapping) and block gather/scatter for the offload path.

Gather and scatter move whole blocks (every layer, K and V: one contiguous run of the
block-major cache) with one launch for any number of blocks, so a batch of chunks costs
one launch, not one per block or per layer. They copy raw bits through an integer view,
so a round trip is byte-exact for every dtype; the widest integer word that divides a
block is used, so each thread moves as many bytes as possible per load.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COPY_TILE = 1024  # words per gather/scatter program
_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv_block,
    stride_kv_kind,
    stride_kv_slot,
    stride_kv_head,
    KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_DIM_PAD)[None, :]
    mask = (heads < KV_HEADS) & (dims < HEAD_DIM)
    dst = (slot // PAGE) * stride_kv_block + (slot % PAGE) * stride_kv_slot
    dst += heads * stride_kv_head + dims
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    tl.store(kv_ptr + dst, key, mask=mask)
    tl.store(kv_ptr + stride_kv_kind + dst, value, mask=mask)


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    ids_ptr,
    block_words,
    IDS_ON_SRC: tl.constexpr,
    TILE: tl.constexpr,
):
    """Row j of the dense side <-> row ids[j] of the cache, `block_words` words each."""
    j = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * TILE + tl.arange(0, TILE)
    mask = offs < block_words
    block = tl.load(ids_ptr + j).to(tl.int64)
    if IDS_ON_SRC:
        src_row, dst_row = block, j.to(tl.int64)
    else:
        src_row, dst_row = j.to(tl.int64), block
    data = tl.load(src_ptr + src_row * block_words + offs, mask=mask)
    tl.store(dst_ptr + dst_row * block_words + offs, data, mask=mask)


def write_kv(
    kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Triton version of `kvkernels.reference.write_kv` (same contract)."""
    num_tokens, kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert kv_layer.stride(4) == 1, "the cache's head_dim must be contiguous"
    key, value = (_unit_last_stride(t.to(kv_layer.dtype)) for t in (key, value))
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_layer,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *kv_layer.stride()[:4],
        KV_HEADS=kv_heads,
        HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        PAGE=kv_layer.shape[2],
    )


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> None:
    """`out[j] = kv_cache[block_ids[j]]`, every block in one launch."""
    _copy_blocks(kv_cache, out, block_ids, ids_on_src=True)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, src: torch.Tensor) -> None:
    """`kv_cache[block_ids[j]] = src[j]`, every block in one launch."""
    _copy_blocks(src, kv_cache, block_ids, ids_on_src=False)


def _copy_blocks(
    src: torch.Tensor, dst: torch.Tensor, block_ids: torch.Tensor, ids_on_src: bool
) -> None:
    assert src.dtype == dst.dtype, "gather/scatter copy bits: cache and chunk dtypes must match"
    assert src.is_contiguous() and dst.is_contiguous(), "block-major tensors must be contiguous"
    assert src.shape[1:] == dst.shape[1:], "chunk blocks and cache blocks differ in shape"
    if block_ids.numel() == 0:
        return
    block_bytes = src[0].numel() * src.element_size()
    width, word = next((w, t) for w, t in _WORDS if block_bytes % w == 0)
    words = block_bytes // width
    grid = (block_ids.numel(), triton.cdiv(words, _COPY_TILE))
    _copy_blocks_kernel[grid](
        src.reshape(-1).view(word),
        dst.reshape(-1).view(word),
        block_ids,
        words,
        IDS_ON_SRC=ids_on_src,
        TILE=_COPY_TILE,
    )
