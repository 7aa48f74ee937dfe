"""Record files read and written with O_DIRECT, through a page-aligned buffer per thread.

Below a cpu tier, the page cache only keeps a second copy of records the cpu tier
already holds in memory, and filling it is not free: every page it takes is allocated
and copied into by the kernel, on the writing thread's CPU time. O_DIRECT moves a record
between the device and user memory without it.

O_DIRECT wants the memory address, the file offset and the length aligned to the
device's logical block. A record whose memory starts on a page (a whole chunk's record
in a host slot: the cpu tier aligns them so) moves in place, all but its last partial
block; what is left, and a record that does not start on a page, goes through a
page-aligned buffer of the I/O thread's own, one memcpy beside the device's transfer,
where buffered I/O makes the kernel copy into (or out of) the page cache. A write pads
its last block and truncates the file back to the record's size, so the file holds
exactly the record, as a buffered write leaves it; a read asks for whole blocks and gets
at most the file's size.

Not every filesystem takes O_DIRECT (tmpfs refuses it at open): `supported` probes a
directory once, and the disk tier falls back to buffered I/O where it fails.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import numpy as np

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
    in_place = _in_place_bytes(view)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o644)
    try:
        _write_at(fd, view[:in_place], 0)
        if in_place < size:
            rest = size - in_place
            buffer = _buffer(_aligned(rest))
            buffer[:rest] = view[in_place:]  # past `rest`, whatever the buffer held: the truncate drops it
            _write_at(fd, buffer[: _aligned(rest)], in_place)
        os.ftruncate(fd, size)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_into(path: Path, out: memoryview) -> int:
    """Read `path` into the start of `out`, up to `out`'s size; the bytes read."""
    in_place = _in_place_bytes(out)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        total = _read_at(fd, out[:in_place], 0)
        if total == in_place < out.nbytes:  # the file may go on past the blocks read in place
            rest = out.nbytes - total
            buffer = _buffer(_aligned(rest))
            count = min(rest, _read_at(fd, buffer[: _aligned(rest)], total))
            out[total : total + count] = buffer[:count]
            total += count
    finally:
        os.close(fd)
    return total


def _in_place_bytes(view: memoryview) -> int:
    """How much of `view` O_DIRECT can move in place: its whole blocks if it starts on one."""
    if not view.nbytes or np.frombuffer(view, dtype=np.uint8).ctypes.data % ALIGN:
        return 0
    return view.nbytes // ALIGN * ALIGN


def _read_at(fd: int, into: memoryview, offset: int) -> int:
    """Fill `into` (whole blocks) from `offset` until it is full or the file ends."""
    done = 0
    while done < into.nbytes:
        count = os.preadv(fd, [into[done:]], offset + done)
        done += count
        if count == 0 or done % ALIGN:  # the end of the file
            break
    return done


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)


def _aligned(size: int) -> int:
    return max(ALIGN, -(-size // ALIGN) * ALIGN)


def _buffer(size: int) -> memoryview:
    """This thread's page-aligned buffer of at least `size` bytes (anonymous mmap)."""
    current: memoryview | None = getattr(_local, "buffer", None)
    if current is None or current.nbytes < size:
        current = _local.buffer = memoryview(mmap.mmap(-1, _aligned(size)))
    return current
