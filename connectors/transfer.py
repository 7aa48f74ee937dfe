"""Block copies between host slots and the device KV cache, one copy each way.

A host tensor here is a view of a store slot's payload: `[n, *block shape]`, laid out as
the device cache lays out its blocks, so a run of consecutive device blocks is one
`copy_`. On CUDA the copies run on a side stream (the slots are pinned, so they are
asynchronous DMA): each first waits for the work queued so far on the compute stream,
and the returned event is what the compute stream waits on before it reads loaded blocks
or overwrites saved ones, without the host ever blocking; a slot is given back or
committed only once its event is done (`when_done` + `poll`). On CPU every copy is
synchronous and done when it returns: the runs of one call are one `kvkernels.copy_runs`,
their bytes split evenly over the engine thread's torch threads (one thread copies at
about half the bandwidth two reach).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch

import kvkernels
from kvstore import host_copy


class CopyEvent:
    """Completion of copies issued by `BlockCopier` (already complete without CUDA)."""

    def __init__(self, event: torch.cuda.Event | None = None) -> None:
        self._event = event

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def synchronize(self) -> None:
        """Block the host until the copies have finished."""
        if self._event is not None:
            self._event.synchronize()

    def wait(self, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: the current one) wait for the copies, without blocking."""
        if self._event is not None:
            (stream or torch.cuda.current_stream()).wait_event(self._event)


def block_runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first index, end index, first block id) of each run of consecutive block ids."""
    start = 0
    for index in range(1, len(block_ids) + 1):
        if index == len(block_ids) or block_ids[index] != block_ids[index - 1] + 1:
            yield start, index, block_ids[start]
            start = index


class BlockCopier:
    """Copies between host tensors and the blocks of `kv_cache`
    (`[num_blocks, *block shape]`), and runs callbacks once copies are done."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache
        cuda = kv_cache.is_cuda
        self.stream = torch.cuda.Stream(kv_cache.device) if cuda else None
        self._inflight: deque[tuple[CopyEvent, Callable[[], None]]] = deque()

    def to_device(self, src: torch.Tensor, block_ids: Sequence[int]) -> CopyEvent:
        """Write `src[j]` into device block `block_ids[j]`; the compute stream waits for it."""
        with self._side():
            runs = [(self.kv_cache[block : block + end - start], src[start:end])
                    for start, end, block in block_runs(block_ids)]
            self._copy(runs)
        event = self._record()
        event.wait()
        return event

    @property
    def copies_from_any_thread(self) -> bool:
        """Whether `to_device_off_engine_thread` may be used: the cache is host memory (a
        CUDA copy belongs on the side stream, issued by the engine thread)."""
        return self.stream is None

    def to_device_off_engine_thread(self, src: torch.Tensor, block_ids: Sequence[int]) -> None:
        """`to_device` on a CPU cache from another thread: one memcpy per run of blocks,
        no torch thread team of its own (it would oversubscribe the engine's cores)."""
        for start, end, block in block_runs(block_ids):
            host_copy(self.kv_cache[block : block + end - start], src[start:end])

    def from_device(self, block_ids: Sequence[int], dst: torch.Tensor) -> CopyEvent:
        """Copy device blocks `block_ids` into `dst[j]`; the compute stream waits for it
        before it can overwrite them."""
        with self._side():
            runs = [(dst[start:end], self.kv_cache[block : block + end - start])
                    for start, end, block in block_runs(block_ids)]
            self._copy(runs)
        event = self._record()
        event.wait()
        return event

    def _copy(self, runs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """(destination, source) pairs: one batched copy on CPU, async copies on CUDA."""
        if not runs:
            return
        if self.stream is None:
            kvkernels.copy_runs([dst for dst, _ in runs], [src for _, src in runs])
            return
        for dst, src in runs:
            dst.copy_(src, non_blocking=True)

    def when_done(self, event: CopyEvent, callback: Callable[[], None]) -> None:
        """Run `callback` on the engine thread once `event` is done (at once on CPU)."""
        self._inflight.append((event, callback))
        self.poll()

    def poll(self) -> None:
        """Run the callbacks of finished copies; copies on one stream finish in order."""
        while self._inflight and self._inflight[0][0].done():
            _, callback = self._inflight.popleft()
            callback()

    def drain(self) -> None:
        """Wait for every copy in flight and run its callback."""
        while self._inflight:
            event, callback = self._inflight.popleft()
            event.synchronize()
            callback()

    @contextmanager
    def _side(self) -> Iterator[None]:
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
        with torch.cuda.stream(self.stream):
            yield

    def _record(self) -> CopyEvent:
        if self.stream is None:
            return CopyEvent()
        event = torch.cuda.Event()
        event.record(self.stream)
        return CopyEvent(event)
