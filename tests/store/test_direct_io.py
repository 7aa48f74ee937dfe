"""O_DIRECT record files: exact bytes from unaligned memory, no page-cache copy left behind,
interchangeable with buffered files, and chosen by the store only below a cpu tier."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import pytest
import torch

from kvstore.config import StoreConfig, build_record_tiers
from kvstore.record import RecordCodec
from kvstore.spec import ChunkSpec
from tiers import DiskTier, PinTable, direct_io


@pytest.fixture
def directory(tmp_path: Path) -> Path:
    if not direct_io.supported(tmp_path):
        pytest.skip("this filesystem refuses O_DIRECT")
    return tmp_path


def resident_pages(path: Path) -> int:
    """Pages of `path` in the page cache (mincore over a mapping of the file)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert address not in (None, ctypes.c_void_p(-1).value)
        try:
            vector = ctypes.create_string_buffer(pages)
            assert libc.mincore(address, size, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(b & 1 for b in vector.raw)
        finally:
            libc.munmap(address, size)
    finally:
        os.close(fd)


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 300_001])
def test_a_record_from_unaligned_memory_is_written_and_read_exactly(directory, size):
    data = os.urandom(size + 7)
    view = memoryview(data)[7:]  # not aligned to anything
    direct_io.write(directory / "r", view, sync=False)
    assert (directory / "r").stat().st_size == size
    assert (directory / "r").read_bytes() == data[7:]
    out = memoryview(bytearray(size + 9000))[3:]
    assert direct_io.read_into(directory / "r", out) == size
    assert bytes(out[:size]) == data[7:]


def test_a_read_stops_at_its_buffers_size(directory):
    data = os.urandom(20_000)
    direct_io.write(directory / "r", data, sync=True)
    out = memoryview(bytearray(5_000))
    assert direct_io.read_into(directory / "r", out) == 5_000 and bytes(out) == data[:5_000]


def test_a_file_written_buffered_is_read_directly(directory):
    data = os.urandom(10_000)
    (directory / "r").write_bytes(data)
    out = memoryview(bytearray(len(data)))
    assert direct_io.read_into(directory / "r", out) == len(data) and bytes(out) == data


def test_a_direct_disk_tier_leaves_no_copy_in_the_page_cache(directory):
    record = os.urandom(256 * 1024)
    direct = DiskTier(directory / "direct", 10 << 20, PinTable(), direct_io=True)
    buffered = DiskTier(directory / "buffered", 10 << 20, PinTable())
    assert direct.direct_io and not buffered.direct_io
    for tier in (direct, buffered):
        assert tier.put([("k-01", record)]) == [True]
    assert resident_pages(direct.path("k-01")) == 0
    assert resident_pages(buffered.path("k-01")) > 0  # the check sees what it looks for
    into = [memoryview(bytearray(len(record) + 100))]
    got = direct.get(["k-01"], into)
    assert bytes(got[0]) == record and resident_pages(direct.path("k-01")) == 0
    # a process with a buffered tier on the same directory reads what this one wrote
    assert DiskTier(directory / "direct", 10 << 20, PinTable()).get(["k-01"]) == [record]


def test_the_store_reads_the_disk_directly_only_below_a_cpu_tier(directory):
    codec = RecordCodec(ChunkSpec(bytes(32), (2, 1, 2, 4, 1, 8), torch.float16, 8))

    def disk_tier(tiers: tuple[str, ...]):
        config = StoreConfig(kv_offload=tiers, kv_offload_disk_path=str(directory / "-".join(tiers)))
        (tier,) = build_record_tiers(codec, config, PinTable())
        return tier

    assert disk_tier(("cpu", "disk")).direct_io
    assert not disk_tier(("disk",)).direct_io
