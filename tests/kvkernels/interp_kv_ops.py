"""Triton KV write and block gather/scatter under TRITON_INTERPRET=1.
Run through test_triton_interpreter.py, in its own process."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import kvkernels
from kvkernels import reference, triton_kv_ops

LAYERS, BLOCK, KV_HEADS, HEAD_DIM = 3, 4, 2, 8


def _random_bits_cache(num_blocks: int, dtype: torch.dtype) -> torch.Tensor:
    """A cache whose bytes are random, NaN payloads and all, so copies must be bit-exact."""
    shape = (num_blocks, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    bits = torch.randint(
        0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    return bits.view(dtype).view(shape)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_gather_scatter_round_trip_is_byte_exact(dtype):
    cache = _random_bits_cache(12, dtype)
    ids = torch.tensor([9, 2, 11, 0, 5, 6])
    chunk = torch.empty(len(ids), *cache.shape[1:], dtype=dtype)
    triton_kv_ops.gather_blocks(cache, ids, chunk)
    for j, block in enumerate(ids.tolist()):
        assert _same_bytes(chunk[j], cache[block])
    restored = torch.zeros_like(cache)
    triton_kv_ops.scatter_blocks(restored, ids, chunk)
    assert _same_bytes(restored[ids], cache[ids])
    untouched = [b for b in range(12) if b not in ids.tolist()]
    assert torch.count_nonzero(restored[untouched].view(torch.uint8)).item() == 0


def test_one_launch_gathers_several_chunks_into_their_slices():
    cache = _random_bits_cache(16, torch.bfloat16)
    chunks = [[3, 4, 10, 1], [15, 0, 7, 8]]
    buffer = torch.empty(8, *cache.shape[1:], dtype=cache.dtype)
    triton_kv_ops.gather_blocks(cache, torch.tensor(chunks).flatten(), buffer)
    for c, blocks in enumerate(chunks):
        assert _same_bytes(buffer[4 * c : 4 * c + 4], cache[blocks])


def test_odd_sized_blocks_use_narrow_words():
    cache = torch.randn(5, 1, 2, 3, 1, 5, dtype=torch.float16)  # 60 bytes per block
    out = torch.empty(2, *cache.shape[1:], dtype=cache.dtype)
    triton_kv_ops.gather_blocks(cache, torch.tensor([4, 1]), out)
    assert _same_bytes(out, cache[[4, 1]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_matches_reference(dtype):
    cache = torch.zeros(6, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    expected = cache.clone()
    qkv = torch.randn(5, 3 * KV_HEADS, HEAD_DIM)
    key, value = qkv[:, :KV_HEADS], qkv[:, KV_HEADS : 2 * KV_HEADS]
    slots = torch.tensor([5, 22, -1, 0, 23])
    triton_kv_ops.write_kv(cache[:, 1], key, value, slots)
    reference.write_kv(expected[:, 1], key, value, slots)
    assert torch.equal(cache, expected)
    assert torch.count_nonzero(cache).item() == 4 * 2 * KV_HEADS * HEAD_DIM


def test_dispatch_forced_to_triton_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(triton_kv_ops, "scatter_blocks", lambda *a: calls.append(a))
    cache = torch.zeros(2, LAYERS, 2, BLOCK, KV_HEADS, HEAD_DIM)
    with kvkernels.use_backend("triton"):
        kvkernels.scatter_blocks(cache, torch.tensor([1]), cache[:1].clone())
    assert len(calls) == 1
