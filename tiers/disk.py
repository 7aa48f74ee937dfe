"""Disk tier: one file per record under a directory, safe to share between processes.

Layout: `<root>/<last two characters of the key>/<key>.kvc`. A write goes to a temporary
`.<key>.<pid>.<random>.tmp` in the same directory and is renamed into place, so a reader
(in this or another process) sees either no file or a complete one. Records are content
addressed, so two processes writing the same key write the same bytes and the rename is
idempotent. A file removed by another process is a miss, not an error, whenever it
goes: before a read, or between the listing of its directory and the read of its head
(a scan reports it as never found). Every method blocks its caller's thread: the store
reads from its read pool, in as many concurrent batches as it sees fit, and writes from
its write pool, so reads never queue behind writes.

The in-memory index (key -> size, in the order of its eviction policy, tiers.eviction)
is rebuilt from the directory at start
(oldest mtime first), reading the first `head_bytes` of every record so that the store
can index its blocks; temporary files left by dead processes, or older than
`stale_tmp_s`, are removed then. `scan()` hands the store what the rebuild found, then,
on each later call, what changed: it rescans only the shard directories whose mtime
changed (another process wrote or removed a file there) and reports new and vanished
records. Membership (`holds`) is answered from memory, never with a stat().

Space: the byte budget is `capacity_bytes` or, when less, what the tier holds plus the
free space of the filesystem (statvfs, re-read at most every SPACE_CHECK_S), so the
effective budget follows the free space. A write that fails with ENOSPC evicts
records to the budget measured again and is retried once; a full
filesystem is a lack of room (put_rejected), not a failure, so the tier stays healthy
and writes resume by themselves when space comes back.

fsync policy: "none" (rename only: atomic for readers, may lose recent records on power
loss; checksums then turn a damaged record into a miss), "file" (fsync the record before
the rename), "full" (also fsync the directory after the rename).

With `direct_io` (the store asks for it when a cpu tier sits above the disk), records
are written and read into slots with O_DIRECT (tiers/direct_io.py), bypassing the page
cache, where the filesystem supports it; the index rebuild's head reads stay buffered.
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from tiers import direct_io
from tiers.base import Buffer, IndexEntry, RecordTier, Scan, check_key
from tiers.errors import TierConfigError
from tiers.eviction import EvictionPolicy, make_policy
from tiers.pins import PinTable

SUFFIX = ".kvc"
TMP_SUFFIX = ".tmp"
FSYNC_POLICIES = ("none", "file", "full")
SPACE_CHECK_S = 0.5
SPACE_HEADROOM_BLOCKS = 4  # filesystem blocks left free: directory entries, rounding
_FULL = (errno.ENOSPC, errno.EDQUOT)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", None)  # Linux 4.14+

log = logging.getLogger(__name__)


class DiskTier(RecordTier):
    name = "disk"

    def __init__(
        self,
        root: str | os.PathLike[str],
        capacity_bytes: int,
        pins: PinTable | None = None,
        fsync: str = "none",
        stale_tmp_s: float = 600.0,
        head_bytes: int = 0,
        direct_io: bool = False,
        eviction: str = "lru",
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
        self.head_bytes = head_bytes
        self.direct_io = direct_io and _direct_io_supported(self.root)
        self._capacity = capacity_bytes
        self._stale_tmp_s = stale_tmp_s
        self._lock = threading.Lock()
        self.eviction = eviction
        self._index: EvictionPolicy[int] = make_policy(eviction)
        self._shards: dict[str, set[str]] = {}  # shard directory -> record names in it
        self._shard_mtimes: dict[str, int] = {}
        self._usage = 0
        self._reserved = 0
        self._space_limit = capacity_bytes
        self._space_at = -float("inf")
        self._removed: list[str] = []
        self._unscanned = Scan()
        self.removed_tmp_files = 0
        self.rebuild()

    @property
    def capacity_bytes(self) -> int:
        """The effective budget: the configured size, or less when the filesystem is fuller."""
        return min(self._capacity, self._space_limit)

    @property
    def usage_bytes(self) -> int:
        return self._usage

    @property
    def entries(self) -> int:
        return len(self._index)

    def path(self, key: str) -> Path:
        return self.root / key[-2:] / f"{key}{SUFFIX}"

    def rebuild(self) -> None:
        """Index every record in the directory (oldest first), read its head, and drop
        stale temp files; the next `scan` reports every record found."""
        found: list[tuple[float, str, int, bytes]] = []
        mtimes: dict[str, int] = {}
        for shard in self._shard_dirs():
            mtimes[shard.name] = _mtime(shard)
            for entry in _files(shard.path):
                if entry.name.endswith(TMP_SUFFIX):
                    self._remove_if_stale(entry)
                elif entry.name.endswith(SUFFIX):
                    record = self._stat_and_head(entry.path)
                    if record is not None:
                        info, head = record
                        found.append((info.st_mtime, entry.name[: -len(SUFFIX)], info.st_size, head))
        found.sort()
        with self._lock:
            self._index = make_policy(self.eviction)
            self._shards = {}
            self._usage = 0
            for _, key, size, _ in found:
                self._add_locked(key, size)
            self._shard_mtimes = mtimes
        victims = set(self._claim_room(0) or ())
        for victim in victims:
            _unlink_quietly(self.path(victim))
        self.take_removed()  # never reported as found
        self._unscanned = Scan(found=[(key, head) for _, key, _, head in found if key not in victims])

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._index

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [self.holds(key) for key in keys]

    def take_removed(self) -> list[str]:
        with self._lock:
            removed, self._removed = self._removed, []
        return removed

    def scan(self) -> Scan:
        first, self._unscanned = self._unscanned, Scan()
        later = self._rescan()
        return Scan(first.found + later.found, first.gone + later.gone)

    def get(
        self, keys: Sequence[str], into: Sequence[memoryview] | None = None
    ) -> list[Buffer | None]:
        start = time.perf_counter()
        jobs = [(self.path(key), into[i] if into else None) for i, key in enumerate(keys)]
        outcomes = _read_files(jobs, self.direct_io)
        records = [self._account_read(key, outcome) for key, outcome in zip(keys, outcomes, strict=True)]
        self.counters.observe_get(time.perf_counter() - start)
        return records

    def read_in_place(self, key: str, buffers: Sequence[memoryview]) -> int | None:
        """A read that the page cache serves whole (RWF_NOWAIT: no wait on the device);
        None with O_DIRECT, which bypasses the page cache."""
        if self.direct_io or _RWF_NOWAIT is None:
            return None
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except OSError:
            return None  # a missing or unreadable file is the usual read's to account
        try:
            size = os.fstat(fd).st_size
            if size > sum(b.nbytes for b in buffers):
                return None
            count = os.preadv(fd, buffers, 0, _RWF_NOWAIT)
        except OSError:
            return None  # EAGAIN: not all of it is cached
        finally:
            os.close(fd)
        if count != size:
            return None
        self._note_read(key, count)
        return count

    def put(
        self, items: Sequence[tuple[str, Buffer]], blocks: Sequence[Sequence[IndexEntry]] | None = None
    ) -> list[bool]:
        stored = [False] * len(items)
        todo: list[tuple[int, str, Buffer, int]] = []
        full: list[tuple[int, str, Buffer, int]] = []
        start, admitted = time.perf_counter(), False
        for index, (key, data) in enumerate(items):
            check_key(key)
            size = memoryview(data).nbytes
            if self.holds(key):
                stored[index] = True
                continue
            room = self._make_room(size)
            if not room and todo:
                # The budget is held by this batch's own writes in flight, which cannot be
                # evicted yet: finish them, so that the newer records may evict them.
                full += self._write(todo, stored)
                todo = []
                room = self._make_room(size)
            if room:
                todo.append((index, key, data, size))
                admitted = True
            else:
                self.counters.add(put_rejected=1)
        full += self._write(todo, stored)
        if full:  # ENOSPC: measure the free space again, make room by evicting, retry once
            self._space_at = -float("inf")
            retry = [item for item in full if self._admit(item[3])]
            self.counters.add(put_rejected=len(self._write(retry, stored)))
        if admitted:
            self.counters.observe_put(time.perf_counter() - start)
        return stored

    def delete(self, keys: Sequence[str]) -> int:
        removed = 0
        for key in keys:
            self._forget(key)
            removed += self._remove(self.path(key))
        self.counters.add(deletes=removed)
        return removed

    def clear(self, prefix: str = "") -> int:
        doomed = [k for k in self._list_names() if k.startswith(prefix) and not self.pins.is_pinned(k)]
        return self.delete(doomed)

    # ---- writes -----------------------------------------------------------------------------

    def _write(
        self, todo: list[tuple[int, str, Buffer, int]], stored: list[bool]
    ) -> list[tuple[int, str, Buffer, int]]:
        """Write `todo`, marking `stored`; returns the items that failed for lack of space
        (their room is released)."""
        if not todo:
            return []
        try:
            outcomes = _write_files([(self.path(key), data) for _, key, data, _ in todo], self.fsync, self.direct_io)
        except BaseException:
            for *_, size in todo:
                self._release_room(size)
            raise
        full = []
        for item, error in zip(todo, outcomes, strict=True):
            index, key, _, size = item
            if error is not None and error.errno in _FULL:
                self._release_room(size)
                full.append(item)
            else:
                stored[index] = self._account_write(key, size, error)
        return full

    def _admit(self, size: int) -> bool:
        """`_make_room`, counting a record that cannot go in as rejected."""
        if self._make_room(size):
            return True
        self.counters.add(put_rejected=1)
        return False

    def _make_room(self, size: int) -> bool:
        """Make room for a new record of `size` bytes (evicting files); False if it cannot
        go in."""
        victims = self._claim_room(size) if self.health.available() else None
        if victims is None:
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
        """Reserve `size` bytes within the effective budget, evicting the policy's first
        unpinned records; None (and nothing evicted) if impossible."""
        budget = self._budget()
        victims: list[str] = []
        with self._lock:
            excess = self._usage + self._reserved + size - budget
            candidates = self._index.candidates(lambda key, _: not self.pins.is_pinned(key))
            while excess > 0:
                victim = next(candidates, None)
                if victim is None:
                    return None
                victims.append(victim)
                excess -= self._index.get(victim, touch=False) or 0
            for victim in victims:
                self._usage -= self._index.evict(victim)
                self._unshard_locked(victim)
            self._reserved += size
            self._removed.extend(victims)
        self.counters.add(evictions=len(victims))
        return victims

    def _budget(self) -> int:
        """min(configured size, held + free - headroom), free space re-read at most
        every SPACE_CHECK_S."""
        now = time.monotonic()
        if now - self._space_at >= SPACE_CHECK_S:
            try:
                info = os.statvfs(self.root)
            except OSError:
                return self._capacity
            with self._lock:
                held = self._usage + self._reserved
            headroom = SPACE_HEADROOM_BLOCKS * info.f_frsize
            self._space_limit = max(0, held + info.f_bavail * info.f_frsize - headroom)
            self._space_at = now
        return self.capacity_bytes

    def _release_room(self, size: int) -> None:
        with self._lock:
            self._reserved -= size

    def _publish(self, key: str, size: int) -> None:
        with self._lock:
            self._reserved -= size
            if key in self._index:  # rewritten: popping an absent key would forget its ghost (ARC)
                self._pop_locked(key)
            self._add_locked(key, size)

    # ---- reads and the index ----------------------------------------------------------------

    def _account_read(self, key: str, outcome: Buffer | OSError) -> Buffer | None:
        if isinstance(outcome, FileNotFoundError):
            self._forget(key)
            return None
        if isinstance(outcome, OSError):
            self.counters.add(errors=1)
            self.health.record_failure(outcome)
            return None
        self._note_read(key, memoryview(outcome).nbytes)
        return outcome

    def _note_read(self, key: str, size: int) -> None:
        with self._lock:
            if key in self._index:
                self._index.get(key)  # a hit: most recently used
        self.counters.add(bytes_read=size)

    def _add_locked(self, key: str, size: int) -> None:
        self._index.add(key, size)
        self._usage += size
        self._shards.setdefault(key[-2:], set()).add(key)

    def _pop_locked(self, key: str) -> int:
        size = self._index.pop(key) or 0
        self._usage -= size
        self._unshard_locked(key)
        return size

    def _unshard_locked(self, key: str) -> None:
        names = self._shards.get(key[-2:])
        if names is not None:
            names.discard(key)

    def _forget(self, key: str) -> None:
        with self._lock:
            if key in self._index:
                self._pop_locked(key)
                self._removed.append(key)

    def _rescan(self) -> Scan:
        """New and vanished records in the shard directories whose mtime changed."""
        scan = Scan()
        for shard in self._shard_dirs():
            mtime = _mtime(shard)
            if self._shard_mtimes.get(shard.name) == mtime:
                continue
            self._shard_mtimes[shard.name] = mtime
            present = {
                e.name[: -len(SUFFIX)] for e in _files(shard.path) if e.name.endswith(SUFFIX)
            }
            with self._lock:
                known = set(self._shards.get(shard.name, ()))
            for key in present - known:
                found = self._adopt(key)
                if found is not None:
                    scan.found.append((key, found))
            for key in known - present:
                self._forget(key)
                scan.gone.append(key)
        return scan

    def _adopt(self, key: str) -> bytes | None:
        """Index a record another process wrote; its head, or None if it vanished."""
        record = self._stat_and_head(self.path(key))
        if record is None:
            return None
        info, head = record
        with self._lock:
            if key not in self._index:
                self._add_locked(key, info.st_size)
        return head

    def _stat_and_head(self, path: str | Path) -> tuple[os.stat_result, bytes] | None:
        """A listed record file's status and first `head_bytes`; None if it is gone.

        Another process may evict the file, or replace it, at any moment after its
        directory was listed. Both come from one open file, so they describe one record,
        and a file gone before the open is no record at all: an empty head would make the
        store count a removal as a damaged record. A file present but unreadable comes
        with an empty head, so that the store drops it as a bad record."""
        try:
            with open(path, "rb", buffering=0) as f:
                return os.fstat(f.fileno()), (f.read(self.head_bytes) if self.head_bytes else b"")
        except FileNotFoundError:
            return None
        except OSError:
            try:
                return os.stat(path), b""
            except OSError:
                return None

    def _list_names(self) -> list[str]:
        return [
            e.name[: -len(SUFFIX)]
            for shard in self._shard_dirs()
            for e in _files(shard.path)
            if e.name.endswith(SUFFIX)
        ]

    def _remove(self, path: Path) -> int:
        try:
            path.unlink()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            self.counters.add(errors=1)
            self.health.record_failure(exc)
            return 0
        return 1

    def _shard_dirs(self) -> Iterator[os.DirEntry[str]]:
        with os.scandir(self.root) as shards:
            yield from (s for s in shards if s.is_dir(follow_symlinks=False))

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


def _files(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as entries:
            return [e for e in entries if e.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _mtime(entry: os.DirEntry[str]) -> int:
    try:
        return entry.stat(follow_symlinks=False).st_mtime_ns
    except FileNotFoundError:
        return 0


def _unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _read_files(jobs: list[tuple[Path, memoryview | None]], direct: bool) -> list[Buffer | OSError]:
    outcomes: list[Buffer | OSError] = []
    for path, buffer in jobs:
        try:
            if direct and buffer is not None:
                outcomes.append(buffer[: direct_io.read_into(path, buffer)])
            else:
                with open(path, "rb", buffering=0) as f:
                    outcomes.append(f.read() if buffer is None else buffer[: _fill(f, buffer)])
        except OSError as exc:
            outcomes.append(exc)
    return outcomes


def _fill(f: io.RawIOBase, buffer: memoryview) -> int:
    """Read into `buffer` until it is full or the file ends; returns the bytes read."""
    total = 0
    while total < buffer.nbytes:
        count = f.readinto(buffer[total:])
        if not count:
            break
        total += count
    return total


def _write_files(jobs: list[tuple[Path, Buffer]], fsync: str, direct: bool) -> list[OSError | None]:
    outcomes: list[OSError | None] = []
    for path, data in jobs:
        try:
            _write_file_atomically(path, data, fsync, direct)
        except OSError as exc:
            outcomes.append(exc)
        else:
            outcomes.append(None)
    return outcomes


def _write_file_atomically(path: Path, data: Buffer, fsync: str, direct: bool) -> None:
    """Write to a temporary name in the same directory, then rename over `path`."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        if direct:
            direct_io.write(tmp, data, sync=fsync != "none")
        else:
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



def _direct_io_supported(root: Path) -> bool:
    if direct_io.supported(root):
        return True
    log.info("disk tier %s: the filesystem refuses O_DIRECT; records use the page cache", root)
    return False


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
