"""A pool of record-sized byte buffers, reused across loads and saves.

A fresh 1 MiB bytearray is served by mmap and first-touch page faults; on the machines
we measured, that made reading a record from the page cache about 6x slower than reading
it into a buffer that was used before. Loads and saves therefore borrow buffers from
this pool and give them back when the record is decoded or written.
"""

from __future__ import annotations

import threading


class BufferPool:
    def __init__(self, size: int, keep: int = 64) -> None:
        self.size = size
        self._keep = keep
        self._free: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self) -> bytearray:
        with self._lock:
            if self._free:
                return self._free.pop()
        return bytearray(self.size)

    def give(self, buffer: bytearray | None) -> None:
        """Return a buffer (None is ignored); beyond `keep` idle buffers it is dropped."""
        if buffer is None:
            return
        with self._lock:
            if len(self._free) < self._keep:
                self._free.append(buffer)
