"""Disk tier: one file per record under a directory, safe to share between processes.

Layout: `<root>/<last two characters of the key>/<key>.kvc`. A write goes to a temporary
`.<key>.<pid>.<random>.tmp` in the same directory and is renamed into place, so a reader
(in this or another process) sees either no file or a complete one. Records are content
addressed, so two processes writing the same key write the same bytes and the rename is
idempotent. A file removed by another process is a miss, not an error. A batch is read
or written by at most `io_jobs` executor jobs (aiofiles.os.wrap), each handling a group
of records, with at most `io_jobs` jobs in flight per tier.

The in-memory index (key -> size, LRU order) is rebuilt from the directory at start
(oldest mtime first), so a restart keeps the cache; temporary files left by dead
processes, or older than `stale_tmp_s`, are removed then. Keys written by another
process after our start are adopted into the index when first looked up.

fsync policy: "none" (rename only: atomic for readers, may lose recent records on power
loss; checksums then turn a damaged record into a miss), "file" (fsync the record before
the rename), "full" (also fsync the directory after the rename).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from itertools import chain
from pathlib import Path

import aiofiles.os

from tiers.base import Buffer, RecordTier, check_key
from tiers.errors import TierConfigError
from tiers.lru import LruIndex
from tiers.pins import PinTable

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
FSYNC_POLICIES = ("none", "file", "full")


class DiskTier(RecordTier):
    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        pins: PinTable | None = None,
        fsync: str = "none",
        io_jobs: int = 4,
        stale_tmp_s: float = 600.0,
    ) -> None:
        super().__init__(pins)
        if fsync not in FSYNC_POLICIES:
            raise TierConfigError(
                f"fsync policy {fsync!r} is not one of {', '.join(FSYNC_POLICIES)}"
            )
        if capacity_bytes <= 0:
            raise TierConfigError(f"disk tier capacity must be positive, got {capacity_bytes}")
        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierConfigError(f"cannot create disk tier directory {self.root}: {exc}") from exc
        self.fsync = fsync
        self._capacity = capacity_bytes
        self._stale_tmp_s = stale_tmp_s
        self._lock = threading.Lock()
        self._index: LruIndex[int] = LruIndex()
        self._usage = 0
        self._reserved = 0
        self._jobs = io_jobs
        self._io_slots = asyncio.Semaphore(io_jobs)
        self.removed_tmp_files = 0
        self.rebuild()

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def usage_bytes(self) -> int:
        return self._usage

    @property
    def entries(self) -> int:
        return len(self._index)

    def path(self, key: str) -> Path:
        return self.root / key[-2:] / f"{key}{SUFFIX}"

    def rebuild(self) -> None:
        """Index every record in the directory (oldest first) and drop stale temp files."""
        found: list[tuple[float, str, int]] = []
        for entry in self._scan():
            if entry.name.endswith(TMP_SUFFIX):
                self._remove_if_stale(entry)
            elif entry.name.endswith(SUFFIX):
                info = entry.stat()
                found.append((info.st_mtime, entry.name[: -len(SUFFIX)], info.st_size))
        found.sort()
        with self._lock:
            self._index = LruIndex()
            self._usage = 0
            for _, key, size in found:
                self._index.add(key, size)
                self._usage += size
        for victim in self._claim_room(0) or ():
            _unlink_quietly(self.path(victim))

    def has_local(self, key: str) -> bool:
        with self._lock:
            if key in self._index:
                return True
        return self._adopt(key)

    async def contains(self, keys: Sequence[str]) -> list[bool]:
        return [self.has_local(key) for key in keys]

    async def get(
        self, keys: Sequence[str], into: Sequence[bytearray] | None = None
    ) -> list[Buffer | None]:
        start = time.perf_counter()
        jobs = [(self.path(key), into[i] if into else None) for i, key in enumerate(keys)]
        outcomes = await asyncio.gather(
            *(self._read_group(group) for group in _split(jobs, self._jobs))
        )
        records = [
            self._account_read(key, outcome)
            for key, outcome in zip(keys, chain.from_iterable(outcomes), strict=True)
        ]
        self.counters.observe_get(time.perf_counter() - start)
        return records

    async def put(self, items: Sequence[tuple[str, Buffer]]) -> list[bool]:
        stored = [False] * len(items)
        todo: list[tuple[int, str, Buffer, int]] = []
        for index, (key, data) in enumerate(items):
            check_key(key)
            if self.has_local(key):
                stored[index] = True
            elif self._admit(key, data):
                todo.append((index, key, data, memoryview(data).nbytes))
        if not todo:
            return stored
        start = time.perf_counter()
        try:
            outcomes = await asyncio.gather(
                *(self._write_group(group) for group in _split(todo, self._jobs))
            )
        except BaseException:
            for *_, size in todo:
                self._release_room(size)
            raise
        for (index, key, _, size), error in zip(todo, chain.from_iterable(outcomes), strict=True):
            stored[index] = self._account_write(key, size, error)
        self.counters.observe_put(time.perf_counter() - start)
        return stored

    async def delete(self, keys: Sequence[str]) -> int:
        removed = 0
        for key in keys:
            self._forget(key)
            removed += await self._remove(self.path(key))
        self.counters.add(deletes=removed)
        return removed

    async def clear(self, prefix: str = "") -> int:
        names = [e.name[: -len(SUFFIX)] for e in self._scan() if e.name.endswith(SUFFIX)]
        doomed = [k for k in names if k.startswith(prefix) and not self.pins.is_pinned(k)]
        return await self.delete(doomed)

    async def _read_group(
        self, jobs: list[tuple[Path, bytearray | None]]
    ) -> list[Buffer | OSError]:
        async with self._io_slots:
            return await _read_files(jobs)

    async def _write_group(self, group: list[tuple[int, str, Buffer, int]]) -> list[OSError | None]:
        async with self._io_slots:
            return await _write_files(
                [(self.path(key), data) for _, key, data, _ in group], self.fsync
            )

    def _account_read(self, key: str, outcome: Buffer | OSError) -> Buffer | None:
        if isinstance(outcome, FileNotFoundError):
            self._forget(key)
            return None
        if isinstance(outcome, OSError):
            self.counters.add(errors=1)
            self.health.record_failure(outcome)
            return None
        self._touch(key, memoryview(outcome).nbytes)
        self.counters.add(bytes_read=memoryview(outcome).nbytes)
        return outcome

    def _admit(self, key: str, data: Buffer) -> bool:
        """Make room for a new record (evicting LRU files); False if it cannot go in."""
        victims = self._claim_room(memoryview(data).nbytes) if self.health.available() else None
        if victims is None:
            self.counters.add(put_rejected=1)
            return False
        for victim in victims:
            _unlink_quietly(self.path(victim))
        return True

    def _account_write(self, key: str, size: int, error: OSError | None) -> bool:
        if error is not None:
            self._release_room(size)
            self.counters.add(errors=1)
            self.health.record_failure(error)
            return False
        self._publish(key, size)
        self.health.record_success()
        self.counters.add(puts=1, bytes_written=size)
        return True

    def _claim_room(self, size: int) -> list[str] | None:
        """Reserve `size` bytes, choosing LRU unpinned victims; None if impossible."""
        victims: list[tuple[str, int]] = []
        with self._lock:
            while self._usage + self._reserved + size > self._capacity:
                victim = self._index.victim(lambda key, _: not self.pins.is_pinned(key))
                if victim is None:
                    for key, victim_size in reversed(victims):  # nothing is unlinked yet
                        self._index.add_oldest(key, victim_size)
                        self._usage += victim_size
                    return None
                victim_size = self._index.pop(victim)
                self._usage -= victim_size
                victims.append((victim, victim_size))
            self._reserved += size
        self.counters.add(evictions=len(victims))
        return [key for key, _ in victims]

    def _release_room(self, size: int) -> None:
        with self._lock:
            self._reserved -= size

    def _publish(self, key: str, size: int) -> None:
        with self._lock:
            self._reserved -= size
            self._usage += size - (self._index.pop(key) or 0)
            self._index.add(key, size)

    def _touch(self, key: str, size: int) -> None:
        with self._lock:
            if self._index.get(key) is None:
                self._index.add(key, size)
                self._usage += size

    def _forget(self, key: str) -> None:
        with self._lock:
            self._usage -= self._index.pop(key) or 0

    def _adopt(self, key: str) -> bool:
        """Index a record another process wrote after our start, if it exists."""
        try:
            size = self.path(key).stat().st_size
        except OSError:
            return False
        self._touch(key, size)
        return True

    async def _remove(self, path: Path) -> int:
        try:
            await aiofiles.os.remove(path)
        except FileNotFoundError:
            return 0
        except OSError as exc:
            self.counters.add(errors=1)
            self.health.record_failure(exc)
            return 0
        return 1

    def _scan(self) -> Iterator[os.DirEntry[str]]:
        with os.scandir(self.root) as shards:
            for shard in shards:
                if not shard.is_dir(follow_symlinks=False):
                    continue
                with contextlib.suppress(FileNotFoundError), os.scandir(shard.path) as files:
                    yield from (f for f in files if f.is_file(follow_symlinks=False))

    def _remove_if_stale(self, entry: os.DirEntry[str]) -> None:
        parts = entry.name.split(".")
        pid = int(parts[-3]) if len(parts) >= 4 and parts[-3].isdigit() else None
        try:
            age = time.time() - entry.stat().st_mtime
        except FileNotFoundError:
            return
        if age > self._stale_tmp_s or pid is None or not _process_alive(pid):
            _unlink_quietly(Path(entry.path))
            self.removed_tmp_files += 1


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _split(items: list, parts: int) -> list[list]:
    """`items` in at most `parts` contiguous groups of near-equal size."""
    size = -(-len(items) // max(1, parts)) or 1
    return [items[i : i + size] for i in range(0, len(items), size)]


def _read_files_sync(jobs: list[tuple[Path, bytearray | None]]) -> list[Buffer | OSError]:
    outcomes: list[Buffer | OSError] = []
    for path, buffer in jobs:
        try:
            with open(path, "rb", buffering=0) as f:
                outcomes.append(
                    f.read() if buffer is None else memoryview(buffer)[: _fill(f, buffer)]
                )
        except OSError as exc:
            outcomes.append(exc)
    return outcomes


def _fill(f: io.RawIOBase, buffer: bytearray) -> int:
    """Read into `buffer` until it is full or the file ends; returns the bytes read."""
    view, total = memoryview(buffer), 0
    while total < len(buffer):
        count = f.readinto(view[total:])
        if not count:
            break
        total += count
    return total


def _write_files_sync(jobs: list[tuple[Path, Buffer]], fsync: str) -> list[OSError | None]:
    outcomes: list[OSError | None] = []
    for path, data in jobs:
        try:
            _write_file_atomically(path, data, fsync)
        except OSError as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)
    return outcomes


def _write_file_atomically(path: Path, data: Buffer, fsync: str) -> None:
    """Write to a temporary name in the same directory, then rename over `path`."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb", buffering=0) as f:
            view = memoryview(data).cast("B")
            while view:
                view = view[f.write(view) :]
            if fsync != "none":
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    if fsync == "full":
        _fsync_dir(path.parent)


# One executor job per group of records: aiofiles' file objects take one hop per call
# (open, read or write, close, rename), which costs more than the I/O of a 1 MiB record.
_read_files = aiofiles.os.wrap(_read_files_sync)
_write_files = aiofiles.os.wrap(_write_files_sync)


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
