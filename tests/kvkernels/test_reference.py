"""The torch reference kernels against a naive fp32 attention and plain indexing."""

from __future__ import annotations

import pytest
import torch

import kvkernels
from kvkernels import reference
from tests.kvkernels.paged_batch import make_batch, naive_attention

MIXED = [(5, 21), (1, 40), (16, 16), (1, 7), (9, 33), (1, 1)]


@pytest.mark.parametrize(
    "shapes",
    [[(20, 20), (33, 33)], [(1, 17), (1, 64), (1, 3)], [(1, 30)], [(7, 50)], MIXED],
    ids=["prefill", "decode", "one-decode", "chunk-after-context", "mixed"],
)
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_attention_matches_naive(shapes, kv_heads, head_dim):
    batch = make_batch(shapes, heads=4, kv_heads=kv_heads, head_dim=head_dim)
    scale = head_dim**-0.5
    out = reference.paged_attention(batch.query, batch.kv_layer, batch.meta, scale)
    torch.testing.assert_close(out, naive_attention(batch, scale), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_attention_low_precision(dtype):
    batch = make_batch(MIXED, dtype=dtype)
    out = reference.paged_attention(batch.query, batch.kv_layer, batch.meta, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), naive_attention(batch, 0.125), atol=2e-2, rtol=2e-2)


def test_write_kv_skips_negative_slots():
    batch = make_batch([(3, 10), (2, 5)], block_size=4)
    cache = torch.zeros_like(batch.kv_layer)
    slots = batch.meta.slot_mapping.clone()
    slots[1] = -1
    key = torch.randn(len(slots), 2, 64)
    value = torch.randn(len(slots), 2, 64)
    reference.write_kv(cache, key, value, slots)
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 4)
        if slot >= 0:
            assert torch.equal(cache[block, 0, offset], key[t])
            assert torch.equal(cache[block, 1, offset], value[t])
    assert torch.count_nonzero(cache).item() == (len(slots) - 1) * 2 * 2 * 64


def test_decode_ignores_non_finite_values_written_past_a_sequence_end():
    # A request whose KV overflowed wrote NaN/inf into a block that a decode now reads
    # past its own end (stale slots of a reused block): write_kv keeps them finite, so
    # the length mask keeps them out.
    batch = make_batch([(1, 17), (1, 40), (1, 5)])
    tables, lens = batch.meta.block_tables, batch.meta.seq_lens_cpu
    stale = torch.tensor([int(tables[i, (n - 1) // 16]) * 16 + n % 16 for i, n in enumerate(lens)])
    poison = torch.full((len(stale), 2, 64), float("nan"))
    poison[0] = float("inf")
    reference.write_kv(batch.kv_layer, poison, -poison, stale)
    assert torch.isfinite(batch.kv_layer).all()
    out = reference.paged_attention(batch.query, batch.kv_layer, batch.meta, 0.125)
    torch.testing.assert_close(out, naive_attention(batch, 0.125), atol=2e-5, rtol=1e-4)


def test_write_kv_into_strided_layer_view():
    cache = torch.zeros(6, 3, 2, 4, 2, 8)
    key, value = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    reference.write_kv(cache[:, 1], key, value, torch.tensor([5, 13]))
    assert torch.equal(cache[1, 1, 0, 1], key[0])
    assert torch.equal(cache[3, 1, 1, 1], value[1])
    assert torch.count_nonzero(cache[:, [0, 2]]).item() == 0


def test_gather_scatter_round_trip():
    cache = torch.randn(10, 3, 2, 4, 2, 8).to(torch.bfloat16)
    ids = torch.tensor([7, 2, 9, 0])
    chunk = torch.empty(4, *cache.shape[1:], dtype=cache.dtype)
    reference.gather_blocks(cache, ids, chunk)
    for j, b in enumerate(ids.tolist()):
        assert torch.equal(chunk[j], cache[b])
    other = torch.zeros_like(cache)
    reference.scatter_blocks(other, ids, chunk)
    assert torch.equal(other[ids], cache[ids])
    assert torch.count_nonzero(other[[1, 3, 4, 5, 6, 8]]).item() == 0


def test_dispatch_auto_uses_reference_on_cpu(monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "gather_blocks", lambda *a: calls.append(a))
    cache = torch.zeros(2, 1, 2, 4, 1, 8)
    kvkernels.gather_blocks(cache, torch.tensor([1]), torch.empty(1, 1, 2, 4, 1, 8))
    assert len(calls) == 1


def test_set_backend_validates_and_restores():
    with pytest.raises(ValueError, match="unknown kernel backend"):
        kvkernels.set_backend("cuda")
    with kvkernels.use_backend("torch"):
        assert kvkernels.get_backend() == "torch"
    assert kvkernels.get_backend() == "auto"
