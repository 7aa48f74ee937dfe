"""Redis tier: records in a standalone Redis or a Redis Cluster, shared by instances.

Batches go out as one non-transactional pipeline (GET/SET/EXISTS per key), which also
works across cluster slots. Records read into caller buffers (the store's slots) come
through tiers.resp on a standalone Redis: received straight into the buffer. The pipeline runs on redis-py's blocking client, in the
thread of the store's pool that calls (a read pool thread for a get, a write pool thread
for a put): its socket path sends big values with sendall and no copy, where the asyncio
client joins a whole pipeline into one buffer and copies it again into the transport.
Every socket operation is bounded by `op_timeout_s`; redis-py's own retries are off so
that the bound holds. A failure marks the tier unhealthy and
later operations return misses without touching the network until the backoff passes
(see tiers.health). A background probe (PING and INFO memory, on the store's maintenance
thread) runs every
`probe_interval_s` while the tier is healthy and every RECOVERY_PROBE_S (at most) while it
is not, whatever the backoff: the tier is healthy again within one probe of Redis
answering, and the connections of before the outage are dropped then, so that no request
trips over a dead socket. Capacity and usage are read from `INFO memory` (maxmemory,
used_memory) by the same probe; evictions are Redis's own business (configure
`maxmemory-policy allkeys-lru`).

Block index: next to each record, one small key per block it holds, under its own
prefix (`<key prefix without the colon>-index:`, `kvtier-index:` by default, so that the
record keyspace holds records only), set with NX and the records' TTL. Other instances
read them (`get_index`) to find which record holds a block they need.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from redis import Redis, RedisCluster
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode
from redis.connection import (
    Connection,
    ConnectionPool,
    Encoder,
    PythonRespSerializer,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import RedisError
from redis.retry import Retry

from tiers.base import Buffer, IndexEntry, RecordTier, Upkeep
from tiers.health import Health
from tiers.pins import PinTable
from tiers.redis_url import RedisTarget, parse_redis_url
from tiers.resp import BulkReader

T = TypeVar("T")
_FAILURES = (RedisError, OSError, TimeoutError)
SOCKET_READ_SIZE = 1 << 18  # replies are whole records: read in big pieces
BUFFER_CUTOFF = 6000  # arguments longer than this are sent as separate buffers
RECOVERY_PROBE_S = 0.25  # probe period while unhealthy
INDEX_VALUE_BYTES = 256  # longest block index entry read back


class RedisTier(RecordTier):
    name = "redis"
    remote = True

    def __init__(
        self,
        url: str,
        pins: PinTable | None = None,
        ttl_s: float | None = None,
        key_prefix: str = "kvtier:",
        op_timeout_s: float = 2.0,
        connect_timeout_s: float = 1.0,
        probe_interval_s: float = 1.0,
        max_connections: int = 32,
    ) -> None:
        super().__init__(pins)
        self.target = parse_redis_url(url)
        self.ttl_ms = None if ttl_s is None else max(1, int(ttl_s * 1000))
        self.key_prefix = key_prefix
        self.index_prefix = key_prefix.rstrip(":") + "-index:"
        self.op_timeout_s = op_timeout_s
        self.probe_interval_s = probe_interval_s
        self._client = _make_client(self.target, op_timeout_s, connect_timeout_s, max_connections)
        # records are read straight into the caller's buffers; a cluster goes through redis-py
        self._reader = None if self.target.cluster else BulkReader(self.target, op_timeout_s, connect_timeout_s)
        self._capacity = 0
        self._usage = 0
        self._entries = 0
        self._run_ids: frozenset[str] | None = None  # the Redis processes the last probe answered from
        self._removed: list[str] = []
        self._lock = threading.Lock()

    @property
    def capacity_bytes(self) -> int:
        """Redis maxmemory summed over masters (0: no limit configured, or unknown yet)."""
        return self._capacity

    @property
    def usage_bytes(self) -> int:
        return self._usage

    @property
    def entries(self) -> int:
        """Keys in the database (all of them, not only ours)."""
        return self._entries

    def contains(self, keys: Sequence[str]) -> list[bool]:
        replies = self._pipelined(keys, lambda pipe, _, key: pipe.exists(key))
        return [False] * len(keys) if replies is None else [bool(r) for r in replies]

    def get(
        self, keys: Sequence[str], into: Sequence[memoryview] | None = None
    ) -> list[Buffer | None]:
        """Pipelined GETs. With `into`, each value is read only up to its buffer's size
        (GETRANGE), so a huge value under one of our keys costs no more memory than a
        record, and copied into the start of its buffer."""
        start = time.perf_counter()
        if into is not None and self._reader is not None:
            names = [self.key_prefix + key for key in keys]
            sizes = self._guarded(lambda: self._reader.get_into(names, into), None)
            if sizes is None:
                return [None] * len(keys)
            self.counters.add(bytes_read=sum(s for s in sizes if s))
            self.counters.observe_get(time.perf_counter() - start)
            return [into[i][:size] if size else None for i, size in enumerate(sizes)]
        if into is None:
            replies = self._pipelined(keys, lambda pipe, _, key: pipe.get(key))
        else:
            replies = self._pipelined(
                keys, lambda pipe, i, key: pipe.getrange(key, 0, into[i].nbytes - 1)
            )
        if replies is None:
            return [None] * len(keys)
        self.counters.add(bytes_read=sum(len(r) for r in replies if r is not None))
        self.counters.observe_get(time.perf_counter() - start)
        records: list[Buffer | None] = []
        for i, reply in enumerate(replies):
            if not reply:  # GETRANGE answers b"" for a missing key
                records.append(None)
            elif into is None:
                records.append(reply)
            else:
                into[i][: len(reply)] = reply
                records.append(into[i][: len(reply)])
        return records

    def get_index(self, names: Sequence[str]) -> list[bytes | None]:
        replies = self._pipelined(
            [self.index_prefix + n for n in names],
            lambda pipe, _, key: pipe.getrange(key, 0, INDEX_VALUE_BYTES - 1),
            prefixed=True,
        )
        return [None] * len(names) if replies is None else [r or None for r in replies]

    def put(
        self, items: Sequence[tuple[str, Buffer]], blocks: Sequence[Sequence[IndexEntry]] | None = None
    ) -> list[bool]:
        """Store records that Redis does not hold yet (records are content addressed), with
        their block index entries: one EXISTS pipeline, then one SET pipeline for the
        missing ones, in one I/O job."""
        if not items:
            return []
        start = time.perf_counter()
        keys = [self.key_prefix + key for key, _ in items]

        def run() -> tuple[list[bool], list[int]]:
            with self._client.pipeline(transaction=False) as pipe:
                for key in keys:
                    pipe.exists(key)
                present = [bool(r) for r in pipe.execute()]
                missing = [i for i, there in enumerate(present) if not there]
                for i in missing:
                    pipe.set(keys[i], items[i][1], px=self.ttl_ms)
                for i in missing if blocks else ():
                    for name, value in blocks[i]:
                        pipe.set(self.index_prefix + name, value, px=self.ttl_ms, nx=True)
                replies = pipe.execute() if missing else []
                for i, ok in zip(missing, replies, strict=False):
                    present[i] = bool(ok)
                return present, missing

        outcome = self._guarded(run, None)
        if outcome is None:
            return [False] * len(items)
        stored, written = outcome
        self.counters.add(
            puts=len(written), bytes_written=sum(memoryview(items[i][1]).nbytes for i in written)
        )
        self.counters.observe_put(time.perf_counter() - start)
        return stored

    def delete(self, keys: Sequence[str]) -> int:
        replies = self._pipelined(keys, lambda pipe, _, key: pipe.delete(key))
        removed = 0 if replies is None else sum(int(r) for r in replies)
        if replies is not None:
            with self._lock:
                self._removed.extend(keys)
        self.counters.add(deletes=removed)
        return removed

    def clear(self, prefix: str = "") -> int:
        """Remove the unpinned records under `prefix`, and the block index entries under it."""
        def scan(pattern_prefix: str) -> list[str]:
            found = self._client.scan_iter(match=f"{pattern_prefix}{prefix}*", count=1000)
            return [k.decode()[len(pattern_prefix) :] for k in found]

        entries = self._guarded(lambda: scan(self.index_prefix), None)
        if entries:
            self._pipelined(
                [self.index_prefix + e for e in entries], lambda pipe, _, key: pipe.delete(key),
                prefixed=True,
            )
        keys = self._guarded(lambda: scan(self.key_prefix), None)
        if not keys:
            return 0
        return self.delete([k for k in keys if not self.pins.is_pinned(k)])

    def take_removed(self) -> list[str]:
        with self._lock:
            removed, self._removed = self._removed, []
        return removed

    def upkeep(self) -> Sequence[Upkeep]:
        return (("redis-probe", self._probe_step),)

    def probe(self) -> bool:
        """One health/usage probe (INFO server and memory, DBSIZE), whatever the backoff;
        True if Redis answered. Coming back from unhealthy, the pooled connections of
        before are dropped first. A Redis process other than the last probe's (a restart,
        or a failover in a cluster) may have lost what it held, though the tier never
        looked unhealthy in between: that is told to the health monitor as an outage."""
        recovering = self.health.state is not Health.HEALTHY
        info = self._guarded(self._read_info, None, force=True, record_success=False)
        if info is None:
            return False
        if recovering:
            self._drop_connections()
        self.health.record_success()
        run_ids, self._capacity, self._usage, self._entries = info
        if self._run_ids is not None and run_ids != self._run_ids:
            self.health.record_restart()
        self._run_ids = run_ids
        return True

    def close(self) -> None:
        self._client.close()
        if self._reader is not None:
            self._reader.close()

    def _probe_step(self) -> float:
        """One probe; the seconds until the next: `probe_interval_s` while healthy, at most
        RECOVERY_PROBE_S while not."""
        self.probe()
        healthy = self.health.state is Health.HEALTHY
        return self.probe_interval_s if healthy else min(self.probe_interval_s, RECOVERY_PROBE_S)

    def _drop_connections(self) -> None:
        if isinstance(self._client, RedisCluster):
            self._client.disconnect_connection_pools()
        else:
            self._client.connection_pool.disconnect()
        if self._reader is not None:
            self._reader.close()

    def _read_info(self) -> tuple[frozenset[str], int, int, int]:
        if isinstance(self._client, RedisCluster):
            servers = list(self._client.info("server", target_nodes=RedisCluster.PRIMARIES).values())
            infos = list(self._client.info("memory", target_nodes=RedisCluster.PRIMARIES).values())
            sizes = self._client.dbsize(target_nodes=RedisCluster.PRIMARIES)
            entries = sum(sizes.values()) if isinstance(sizes, dict) else int(sizes)
        else:
            servers = [self._client.info("server")]
            infos = [self._client.info("memory")]
            entries = self._client.dbsize()
        run_ids = frozenset(str(i.get("run_id", "")) for i in servers)
        capacity = sum(int(i.get("maxmemory", 0)) for i in infos)
        usage = sum(int(i.get("used_memory", 0)) for i in infos)
        return run_ids, capacity, usage, entries

    def _pipelined(
        self, keys: Sequence[str], add: Callable[[Any, int, str], Any], prefixed: bool = False,
    ) -> list | None:
        """Run `add(pipe, index, prefixed_key)` per key in one pipeline; None if Redis
        failed. `prefixed`: the keys already carry their prefix."""
        if not keys:
            return []
        prefix = "" if prefixed else self.key_prefix

        def run() -> list:
            with self._client.pipeline(transaction=False) as pipe:
                for index, key in enumerate(keys):
                    add(pipe, index, prefix + key)
                return pipe.execute()

        return self._guarded(run, None)

    def _guarded(
        self, op: Callable[[], T], fallback: T, force: bool = False, record_success: bool = True,
    ) -> T:
        """Run blocking `op` (its sockets time out after `op_timeout_s`); failures are
        counted, change health and give `fallback`."""
        if not force and not self.health.available():
            return fallback
        try:
            result = op()
        except _FAILURES as exc:
            self.counters.add(errors=1)
            self.health.record_failure(exc)
            return fallback
        if record_success:
            self.health.record_success()
        return result


def _make_client(
    target: RedisTarget, op_timeout_s: float, connect_timeout_s: float, max_connections: int
) -> Redis | RedisCluster:
    common: dict[str, Any] = {
        "username": target.username,
        "password": target.password,
        "socket_timeout": op_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "max_connections": max_connections,
        "socket_read_size": SOCKET_READ_SIZE,
    }
    if target.cluster:
        nodes = [ClusterNode(host, port) for host, port in target.nodes]
        return RedisCluster(
            startup_nodes=nodes, ssl=target.ssl, retry=Retry(NoBackoff(), 1), **common
        )
    if target.socket_path is not None:
        place: dict[str, Any] = {"connection_class": UnixDomainSocketConnection, "path": target.socket_path}
    else:
        host, port = target.nodes[0]
        place = {"connection_class": SSLConnection if target.ssl else Connection, "host": host, "port": port}
    pool = ConnectionPool(
        **place,
        db=target.db,
        retry=Retry(NoBackoff(), 0),
        # redis-py's Python packer sends a big value as its own buffer; the hiredis packer
        # (chosen by default when hiredis is installed) copies every value into one bytes.
        command_packer=PythonRespSerializer(
            BUFFER_CUTOFF, Encoder("utf-8", "strict", False).encode
        ),
        **common,
    )
    return Redis(connection_pool=pool)
