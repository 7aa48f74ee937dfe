"""Host staging for the CPU tier: a pool of pinned buffers and side-stream copies.

On CUDA, saving a chunk gathers its blocks and copies them to a pinned host buffer on a
separate stream, ordered after the work already queued on the compute stream but never
blocking it; loading does the reverse, and the compute stream waits on the returned
event only before it reads the loaded blocks. Without CUDA the same API does plain
synchronous copies into ordinary memory, and cupy is never imported.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kernels import gather_blocks, scatter_blocks


def allocate_host(nbytes: int, pin: bool | None = None) -> tuple[torch.Tensor, str]:
    """A uint8 host tensor of `nbytes` and how it was allocated ("cupy", "torch", "plain").

    Pinned by default when CUDA exists. cupy's pinned allocator is preferred because
    torch's caching host allocator rounds a request up to a power of two (a 5 GiB slab
    would pin 8 GiB)."""
    if pin is None:
        pin = torch.cuda.is_available()
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8), "plain"
    cupy = _import_cupy()
    if cupy is not None:
        return _cupy_pinned(cupy, nbytes), "cupy"
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "torch"


def _import_cupy() -> Any:
    try:
        import cupy
    except ImportError:
        return None
    return cupy


def _cupy_pinned(cupy: Any, nbytes: int) -> torch.Tensor:
    import numpy as np

    memory = cupy.cuda.alloc_pinned_memory(nbytes)
    # numpy keeps `memory` alive through the array's base, torch through the array.
    return torch.from_numpy(np.frombuffer(memory, dtype=np.uint8, count=nbytes))


class StagingBuffer:
    """One fixed-size slot of a `StagingPool`; use it as a context manager to release."""

    def __init__(self, pool: StagingPool, index: int, data: torch.Tensor) -> None:
        self.pool, self.index, self.data = pool, index, data

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size) -> torch.Tensor:
        """The first bytes of the slot as a tensor of `dtype` and `shape`."""
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if nbytes > self.data.numel():
            raise ValueError(f"{nbytes} bytes do not fit a {self.data.numel()}-byte buffer")
        return self.data[:nbytes].view(dtype).view(shape)

    def release(self) -> None:
        self.pool.release(self)

    def __enter__(self) -> StagingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StagingPool:
    """`num_buffers` host buffers of `buffer_bytes` carved from one slab allocated once."""

    def __init__(self, buffer_bytes: int, num_buffers: int, *, pin: bool | None = None) -> None:
        if buffer_bytes <= 0 or num_buffers <= 0:
            raise ValueError("buffer_bytes and num_buffers must be positive")
        self.buffer_bytes, self.num_buffers = buffer_bytes, num_buffers
        self.slab, self.kind = allocate_host(buffer_bytes * num_buffers, pin)
        self._free: deque[int] = deque(range(num_buffers))
        self._cond = threading.Condition()

    @property
    def pinned(self) -> bool:
        return self.kind != "plain"

    @property
    def free_buffers(self) -> int:
        with self._cond:
            return len(self._free)

    def acquire(self, timeout: float | None = None) -> StagingBuffer:
        """Take a free buffer, waiting up to `timeout` seconds (forever if None)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._free, timeout):
                raise TimeoutError(f"no staging buffer free after {timeout} s")
            index = self._free.popleft()
        start = index * self.buffer_bytes
        return StagingBuffer(self, index, self.slab[start : start + self.buffer_bytes])

    def release(self, buffer: StagingBuffer) -> None:
        with self._cond:
            if buffer.pool is not self or buffer.index in self._free:
                raise ValueError("buffer released twice or to the wrong pool")
            self._free.append(buffer.index)
            self._cond.notify()


class CopyEvent:
    """Completion of a copy issued by `CopyStream` (already complete without CUDA)."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def synchronize(self) -> None:
        """Block the host until the copy has finished."""
        if self._event is not None:
            self._event.synchronize()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the copy, without blocking."""
        if self._event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._event)


class CopyStream:
    """Issues gathers/scatters and device<->host copies on a side CUDA stream.

    Every operation first waits for the work queued so far on the caller's current
    stream (so it sees the KV the model wrote), then runs on the side stream."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        default = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device or default)
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> CopyEvent:
        """`dst.copy_(src)` on the side stream (host<->device in either direction)."""
        with self._side(src, dst):
            dst.copy_(src, non_blocking=True)
        return self._record()

    def save_blocks(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, host_dst: torch.Tensor
    ) -> CopyEvent:
        """Gather blocks `block_ids` of the device cache into `host_dst` (record layout).
        `host_dst` must stay untouched until the returned event is done."""
        if self.stream is None:
            gather_blocks(kv_cache, block_ids, host_dst)
            return CopyEvent()
        with self._side(kv_cache):
            block_ids = block_ids.to(self.device, non_blocking=True)
            scratch = torch.empty(host_dst.shape, dtype=kv_cache.dtype, device=self.device)
            gather_blocks(kv_cache, block_ids, scratch)
            host_dst.copy_(scratch, non_blocking=True)
        return self._record()

    def load_blocks(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, host_src: torch.Tensor
    ) -> CopyEvent:
        """Scatter `host_src` (record layout) into blocks `block_ids` of the device cache.
        Call `.wait()` on the result before the compute stream reads those blocks, and
        keep `host_src` untouched until it is done."""
        if self.stream is None:
            scatter_blocks(kv_cache, block_ids, host_src)
            return CopyEvent()
        with self._side(kv_cache):
            block_ids = block_ids.to(self.device, non_blocking=True)
            scratch = host_src.to(self.device, non_blocking=True)
            scatter_blocks(kv_cache, block_ids, scratch)
        return self._record()

    @contextmanager
    def _side(self, *tensors: torch.Tensor) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield
        for tensor in tensors:
            if tensor.is_cuda:
                # The caching allocator must not hand this memory out again before
                # the side stream is done with it.
                tensor.record_stream(self.stream)

    def _record(self) -> CopyEvent:
        if self.stream is None:
            return CopyEvent()
        event = torch.cuda.Event()
        event.record(self.stream)
        return CopyEvent(event)
