"""Block-run copies between host tensors and the device cache; without CUDA they are
synchronous and their callbacks run at once."""

from __future__ import annotations

import torch

from connectors.transfer import BlockCopier, block_runs


def test_block_runs_split_ids_into_consecutive_runs():
    assert list(block_runs([4, 5, 6, 1, 9, 10])) == [(0, 3, 4), (3, 4, 1), (4, 6, 9)]
    assert list(block_runs([])) == []


def test_copies_round_trip_blocks_in_any_order():
    cache = torch.randn(12, 2, 2, 4, 1, 8).to(torch.bfloat16)
    ids = [6, 7, 1, 3, 4]
    copier = BlockCopier(cache)
    host = torch.empty(len(ids), *cache.shape[1:], dtype=cache.dtype)
    saved = copier.from_device(ids, host)
    assert saved.done() and torch.equal(host, cache[ids])
    restored = BlockCopier(torch.zeros_like(cache))
    loaded = restored.to_device(host, ids)
    loaded.synchronize()
    assert torch.equal(restored.kv_cache[ids], cache[ids])
    others = [b for b in range(12) if b not in ids]
    assert torch.count_nonzero(restored.kv_cache[others]) == 0


def test_callbacks_run_once_their_copies_are_done():
    copier = BlockCopier(torch.zeros(4, 1, 2, 2, 1, 2))
    ran = []
    event = copier.to_device(torch.ones(2, 1, 2, 2, 1, 2), [0, 1])
    copier.when_done(event, lambda: ran.append("load"))
    copier.drain()
    assert ran == ["load"]
