"""Triton paged attention under TRITON_INTERPRET=1, against the torch reference and a
naive fp32 attention. Run through test_triton_interpreter.py, in its own process."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

import kvkernels
from kvkernels import reference, triton_attention
from tests.kvkernels.paged_batch import make_batch, naive_attention

SHAPES = {
    "prefill": [(20, 20), (33, 33)],
    "decode": [(1, 17), (1, 40), (1, 3), (1, 16)],
    "chunk-after-context": [(7, 50), (16, 35)],
    "mixed": [(5, 21), (1, 40), (16, 16), (1, 7), (9, 33), (1, 1)],
}


def _check(batch, atol=2e-5, rtol=1e-4):
    scale = batch.query.shape[-1] ** -0.5
    out = triton_attention.paged_attention(batch.query, batch.kv_layer, batch.meta, scale)
    assert out.dtype == batch.query.dtype
    torch.testing.assert_close(out.float(), naive_attention(batch, scale), atol=atol, rtol=rtol)
    ref = reference.paged_attention(batch.query, batch.kv_layer, batch.meta, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("kind", SHAPES)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_fp32_head_dim_64(kind, kv_heads):
    _check(make_batch(SHAPES[kind], heads=4, kv_heads=kv_heads, head_dim=64))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_fp32_head_dim_128(kv_heads):
    _check(make_batch(SHAPES["mixed"], heads=4, kv_heads=kv_heads, head_dim=128))


def test_pages_smaller_than_key_tile_and_odd_head_dim():
    _check(make_batch(SHAPES["mixed"], heads=6, kv_heads=2, head_dim=80, block_size=8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_cache(dtype):
    # The interpreter truncates when it stores bf16, so allow one ulp more than rounding.
    _check(make_batch(SHAPES["mixed"], dtype=dtype), atol=3e-2, rtol=1e-2)


def test_strided_query_and_layer_view():
    batch = make_batch(SHAPES["mixed"], heads=4, kv_heads=2, head_dim=64)
    qkv = torch.randn(batch.query.shape[0], 8, 64)
    qkv[:, :4] = batch.query
    cache = torch.randn(batch.kv_layer.shape[0], 3, *batch.kv_layer.shape[1:])
    cache[:, 1] = batch.kv_layer
    batch.query, batch.kv_layer = qkv[:, :4], cache[:, 1]
    _check(batch)


def test_dispatch_forced_to_triton_on_cpu():
    batch = make_batch(SHAPES["decode"])
    with kvkernels.use_backend("triton"):
        out = kvkernels.paged_attention(batch.query, batch.kv_layer, batch.meta, 0.125)
    torch.testing.assert_close(out, naive_attention(batch, 0.125), atol=2e-5, rtol=1e-4)
