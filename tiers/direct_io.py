"""Record files read and written with O_DIRECT, through a page-aligned buffer per thread.

Below a cpu tier, the page cache only keeps a second copy of records the cpu tier
already holds in memory, and filling it is not free: every page it takes is allocated
and copied into by the kernel, on the writing thread's CPU time. O_DIRECT moves a record
between the device and user memory without it.

O_DIRECT wants the memory address, the file offset and the length aligned to the
device's logical block. A record is none of these (it starts where its header does,
inside a slot), so each I/O thread moves records through a page-aligned buffer of its
own: one memcpy beside the device's transfer, where buffered I/O makes the kernel copy
into (or out of) the page cache. A write pads the record to `ALIGN` and truncates the
file back to the record's size, so the file holds exactly the record, as a buffered
write leaves it; a read asks for the aligned length and gets at most the file's size.

Not every filesystem takes O_DIRECT (tmpfs refuses it at open): `supported` probes a
directory once, and the disk tier falls back to buffered I/O where it fails.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

from tiers.base import Buffer

ALIGN = 4096  # covers the logical block of every common device (512 or 4096 bytes)

_local = threading.local()


def supported(directory: Path) -> bool:
    """Whether files in `directory` can be written and read with O_DIRECT."""
    probe = directory / f".direct-io-probe.{os.getpid()}.{threading.get_native_id()}"
    try:
        write(probe, b"\0", sync=False)
        return read_into(probe, memoryview(bytearray(1))) == 1
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def write(path: Path, data: Buffer, sync: bool) -> None:
    """Create `path` (it must not exist) holding exactly `data`; fsync it if `sync`."""
    view = memoryview(data).cast("B")
    size = view.nbytes
    padded = _aligned(size)
    buffer = _buffer(padded)
    buffer[:size] = view  # past `size`, whatever the buffer held: the truncate drops it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        done = 0
        while done < padded:
            done += os.write(fd, buffer[done:padded])
        os.ftruncate(fd, size)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_into(path: Path, out: memoryview) -> int:
    """Read `path` into the start of `out`, up to `out`'s size; the bytes read."""
    padded = _aligned(out.nbytes)
    buffer = _buffer(padded)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        total = 0
        while total < padded:
            count = os.readv(fd, [buffer[total:padded]])
            total += count
            if count == 0 or total % ALIGN:  # the end of the file
                break
    finally:
        os.close(fd)
    total = min(total, out.nbytes)
    out[:total] = buffer[:total]
    return total


def _aligned(size: int) -> int:
    return max(ALIGN, -(-size // ALIGN) * ALIGN)


def _buffer(size: int) -> memoryview:
    """This thread's page-aligned buffer of at least `size` bytes (anonymous mmap)."""
    current: memoryview | None = getattr(_local, "buffer", None)
    if current is None or current.nbytes < size:
        current = _local.buffer = memoryview(mmap.mmap(-1, _aligned(size)))
    return current
