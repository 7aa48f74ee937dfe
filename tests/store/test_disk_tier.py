"""Disk tier on real files: atomic writes, restart, stale temp files, byte-budget LRU."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.store.store_helpers import resident_fraction
from tiers import DiskTier, PinTable, TierConfigError


def record(i: int, size: int = 1000) -> bytes:
    return bytes([i % 256]) * size


def test_get_reads_into_the_callers_buffers(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    tier.put([("k-01", record(1)), ("k-02", record(2, 30))])
    buffers = [memoryview(bytearray(1000)), memoryview(bytearray(20))]
    got = tier.get(["k-01", "k-02"], buffers)
    assert got[0].obj is buffers[0].obj and bytes(got[0]) == record(1)
    assert bytes(got[1]) == record(2, 20)  # cut to its buffer: the decoder rejects it


def test_put_get_and_no_temp_files_left(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    assert tier.put([("k-01", record(1)), ("k-02", record(2))]) == [True, True]
    assert tier.get(["k-01", "k-02", "k-03"]) == [record(1), record(2), None]
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["k-01.kvc", "k-02.kvc"]
    assert tier.usage_bytes == 2000 and tier.counters["bytes_written"] == 2000


@pytest.mark.parametrize("fsync", ["none", "file", "full"])
def test_fsync_policies_write_the_same_bytes(tmp_path, fsync):
    tier = DiskTier(tmp_path, 10_000, fsync=fsync)
    tier.put([("k-aa", record(7))])
    assert tier.get(["k-aa"]) == [record(7)]


def test_bad_configuration_is_refused(tmp_path):
    with pytest.raises(TierConfigError):
        DiskTier(tmp_path, 10, fsync="sometimes")
    with pytest.raises(TierConfigError):
        DiskTier(tmp_path, 0)
    (tmp_path / "file").write_text("x")
    with pytest.raises(TierConfigError):
        DiskTier(tmp_path / "file" / "sub", 10)


def test_restart_rebuilds_the_index_in_lru_order(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    for i in range(3):
        tier.put([(f"k-{i:02d}", record(i))])
        os.utime(tier.path(f"k-{i:02d}"), (1000 + i, 1000 + i))
    again = DiskTier(tmp_path, 10_000)
    assert again.entries == 3 and again.usage_bytes == 3000
    assert again.get(["k-01"]) == [record(1)]
    smaller = DiskTier(tmp_path, 2_000)  # a smaller budget evicts the oldest at start
    assert [smaller.holds(f"k-{i:02d}") for i in range(3)] == [False, True, True]


def test_stale_temp_files_are_removed_at_start(tmp_path):
    shard = tmp_path / "01"
    shard.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    dead_pid = int(dead.stdout)
    (shard / f".k-01.{dead_pid}.abcd1234.tmp").write_bytes(b"partial")
    live = shard / f".k-02.{os.getpid()}.abcd1234.tmp"
    live.write_bytes(b"being written by a live process")
    old = shard / f".k-03.{os.getpid()}.ffff0000.tmp"
    old.write_bytes(b"abandoned long ago")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    tier = DiskTier(tmp_path, 10_000, stale_tmp_s=600)
    assert tier.removed_tmp_files == 2
    assert sorted(p.name for p in shard.iterdir()) == [live.name]
    assert tier.entries == 0


def test_a_batch_larger_than_the_budget_keeps_its_newest_records(tmp_path):
    tier = DiskTier(tmp_path, 3_500)
    keys = [f"k-{i:02d}" for i in range(8)]
    assert tier.put([(k, record(i)) for i, k in enumerate(keys)]) == [True] * 8
    assert [tier.holds(k) for k in keys] == [False] * 5 + [True] * 3
    assert tier.counters["evictions"] == 5 and tier.counters["put_rejected"] == 0
    assert tier.usage_bytes == 3000
    assert sorted(p.name for p in tmp_path.rglob("*.kvc")) == [f"{k}.kvc" for k in keys[5:]]


def test_byte_budget_evicts_lru_and_spares_pins(tmp_path):
    pins = PinTable()
    tier = DiskTier(tmp_path, 3_500, pins)
    pins.pin(["k-00"])
    for i in range(6):
        assert tier.put([(f"k-{i:02d}", record(i))])
        assert tier.usage_bytes <= 3_500
    present = [i for i in range(6) if tier.path(f"k-{i:02d}").exists()]
    assert present == [0, 4, 5]
    assert tier.counters["evictions"] == 3
    pins.pin(["k-04", "k-05"])
    assert tier.put([("k-06", record(6))]) == [False]
    assert tier.counters["put_rejected"] == 1


def test_record_larger_than_the_budget_is_rejected(tmp_path):
    tier = DiskTier(tmp_path, 500)
    assert tier.put([("k-00", record(0))]) == [False]


def test_file_removed_by_another_process_is_a_miss(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    tier.put([("k-01", record(1))])
    tier.path("k-01").unlink()
    assert tier.get(["k-01"]) == [None]
    assert tier.entries == 0 and tier.counters["errors"] == 0
    assert tier.take_removed() == ["k-01"]


def test_scan_lists_the_records_found_at_start_with_their_heads(tmp_path):
    writer = DiskTier(tmp_path, 10_000)
    writer.put([("k-01", record(1)), ("k-02", record(2))])
    tier = DiskTier(tmp_path, 10_000, head_bytes=8)
    first = tier.scan()
    assert sorted(first.found) == [("k-01", record(1, 8)), ("k-02", record(2, 8))] and first.gone == []
    assert tier.scan().found == []  # nothing changed since


def test_scan_finds_what_another_process_wrote_or_removed_after_start(tmp_path):
    mine = DiskTier(tmp_path, 10_000, head_bytes=4)
    other = DiskTier(tmp_path, 10_000)
    mine.put([("k-01", record(1))])
    mine.scan()
    assert not mine.holds("k-05")  # no stat() behind a lookup: learnt by the next scan
    other.put([("k-05", record(5))])
    other.path("k-01").unlink()
    later = mine.scan()
    assert later.found == [("k-05", record(5, 4))] and later.gone == ["k-01"]
    assert mine.holds("k-05") and not mine.holds("k-01") and mine.usage_bytes == 1000
    assert mine.get(["k-05"]) == [record(5)]


@pytest.mark.parametrize("scanned", ["at start", "after start"])
def test_a_record_removed_as_its_head_is_read_is_not_found(tmp_path, before_open, scanned):
    mine = DiskTier(tmp_path, 10_000, head_bytes=4) if scanned == "after start" else None
    other = DiskTier(tmp_path, 10_000)
    other.put([("k-01", record(1)), ("k-05", record(5))])
    before_open(other.path("k-05"), other.path("k-05").unlink)  # evicted once listed
    mine = mine or DiskTier(tmp_path, 10_000, head_bytes=4)
    assert mine.scan().found == [("k-01", record(1, 4))]  # never ("k-05", b""): not a bad record
    assert not mine.holds("k-05") and mine.usage_bytes == 1000


def test_a_record_replaced_as_its_head_is_read_is_indexed_as_the_file_read(tmp_path, before_open):
    mine = DiskTier(tmp_path, 10_000, head_bytes=4)
    other = DiskTier(tmp_path, 10_000)
    other.put([("k-05", record(5))])
    replacement = tmp_path / "replacement"
    replacement.write_bytes(record(6, 600))
    before_open(other.path("k-05"), lambda: os.replace(replacement, other.path("k-05")))
    assert mine.scan().found == [("k-05", record(6, 4))]
    assert mine.usage_bytes == 600


def test_write_error_makes_the_tier_unhealthy_then_it_recovers(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    tier.health = type(tier.health)(min_backoff_s=0.01)
    (tmp_path / "01").write_text("a file where the shard directory should be")
    assert tier.put([("k-01", record(1))]) == [False]
    assert tier.health.state == "unhealthy" and tier.counters["errors"] == 1
    (tmp_path / "01").unlink()
    time.sleep(0.02)
    assert tier.put([("k-01", record(1))]) == [True]
    assert tier.health.state == "healthy"


def test_clear_removes_only_the_prefix(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    tier.put([("m1-k-01", record(1)), ("m1-k-02", record(2)), ("m2-k-01", record(3))])
    assert tier.clear("m1-") == 2
    assert [tier.path(k).exists() for k in ("m1-k-01", "m1-k-02", "m2-k-01")] == [
        False,
        False,
        True,
    ]
    assert tier.usage_bytes == 1000


def test_read_in_place_scatters_a_cached_record_and_declines_what_it_cannot_read_now(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    data = bytes(range(256)) * 4
    tier.put([("k-01", data)])
    pieces = [memoryview(bytearray(100)), memoryview(bytearray(900)), memoryview(bytearray(40))]
    assert tier.read_in_place("k-01", pieces) == 1024  # just written: in the page cache
    assert b"".join(bytes(p) for p in pieces)[:1024] == data
    assert tier.counters["bytes_read"] == 1024
    assert tier.read_in_place("k-02", pieces) is None  # not there
    assert tier.read_in_place("k-01", pieces[:2]) is None  # longer than the buffers


def cached_fraction(path) -> float:
    """Of the file's pages, the fraction in the page cache."""
    import mmap

    import numpy as np

    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mapping:
        view = np.frombuffer(mapping, dtype=np.uint8)
        fraction = resident_fraction(view.ctypes.data, size)
        del view
        return fraction


@pytest.mark.skipif(sys.platform != "linux", reason="RWF_NOWAIT and fadvise are Linux's")
def test_read_in_place_declines_a_record_the_page_cache_does_not_hold(tmp_path):
    tier = DiskTier(tmp_path, 10_000)
    tier.put([("k-01", os.urandom(8192))])
    fd = os.open(tier.path("k-01"), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    cached = cached_fraction(tier.path("k-01"))  # 1 on tmpfs, which has no device to wait on
    got = tier.read_in_place("k-01", [memoryview(bytearray(8192))])
    assert got == (8192 if cached == 1 else None)
    assert tier.get(["k-01"])[0] is not None  # the usual read gets it
