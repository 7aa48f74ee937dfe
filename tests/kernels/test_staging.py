"""The staging pool and copy stream; on a machine without CUDA they copy synchronously."""

from __future__ import annotations

import threading

import pytest
import torch

from kernels.staging import CopyStream, StagingPool, allocate_host


def test_allocate_host_without_pinning():
    data, kind = allocate_host(64, pin=False)
    assert (data.dtype, data.numel(), kind) == (torch.uint8, 64, "plain")


def test_pool_hands_out_disjoint_buffers_and_views():
    pool = StagingPool(buffer_bytes=256, num_buffers=2, pin=False)
    a, b = pool.acquire(), pool.acquire()
    assert pool.free_buffers == 0 and not pool.pinned
    a.view(torch.float32, (4, 16)).fill_(1.0)
    b.view(torch.bfloat16, (128,)).fill_(2.0)
    assert torch.all(a.view(torch.float32, (64,)) == 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        a.view(torch.float32, (65,))
    a.release()
    with pytest.raises(ValueError, match="released twice"):
        a.release()
    with b:
        pass
    assert pool.free_buffers == 2


def test_acquire_times_out_then_wakes_on_release():
    pool = StagingPool(buffer_bytes=8, num_buffers=1, pin=False)
    held = pool.acquire()
    with pytest.raises(TimeoutError):
        pool.acquire(timeout=0.01)
    timer = threading.Timer(0.05, held.release)
    timer.start()
    assert pool.acquire(timeout=5).index == 0
    timer.join()


def test_copy_stream_round_trips_blocks_on_cpu():
    stream = CopyStream()
    cache = torch.randn(8, 2, 2, 4, 1, 8).to(torch.bfloat16)
    ids = torch.tensor([6, 1, 3])
    pool = StagingPool(buffer_bytes=3 * cache[0].numel() * 2, num_buffers=1, pin=False)
    with pool.acquire() as buffer:
        chunk = buffer.view(cache.dtype, (3, *cache.shape[1:]))
        saved = stream.save_blocks(cache, ids, chunk)
        saved.synchronize()
        assert saved.done() and torch.equal(chunk, cache[ids])
        restored = torch.zeros_like(cache)
        loaded = stream.load_blocks(restored, ids, chunk)
        loaded.wait()
        assert torch.equal(restored[ids], cache[ids])
        assert stream.copy(restored[0], cache[0]).done()
        assert torch.equal(restored[0], cache[0])
