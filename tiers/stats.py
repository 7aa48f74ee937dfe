"""Per-tier counters and their immutable snapshot.

Counters are bumped from the engine thread (cpu tier copies) and from the store's I/O
thread, so every update takes a small lock. Latencies go into fixed buckets so that the
server can export them as Prometheus histograms without keeping samples.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import asdict, dataclass

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

COUNTER_FIELDS: tuple[str, ...] = (
    "hits",  # chunks this tier delivered to a load or prefetch
    "misses",  # chunks asked of this tier that it could not deliver (absent, bad, failed)
    "bytes_read",
    "bytes_written",
    "puts",  # chunks stored
    "put_rejected",  # chunks not stored: no room (everything else pinned or in use)
    "evictions",
    "deletes",
    "errors",  # I/O, network or timeout failures
    "checksum_failures",  # truncated or corrupted records (xxh3 mismatch)
    "auth_failures",  # HMAC missing or wrong
    "rejected_records",  # well-formed records of another model, layout or format version
    "probe_timeouts",  # block index probes past the store's lookup timeout (remote tiers)
)


@dataclass(frozen=True)
class LatencySnapshot:
    """Cumulative bucket counts (Prometheus `le` semantics; last bucket is +Inf)."""

    buckets_s: tuple[float, ...]
    cumulative_counts: tuple[int, ...]
    sum_s: float
    count: int


class LatencyHistogram:
    def __init__(self, buckets_s: tuple[float, ...] = LATENCY_BUCKETS_S) -> None:
        self._buckets = buckets_s
        self._counts = [0] * (len(buckets_s) + 1)
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        self._counts[bisect_left(self._buckets, seconds)] += 1
        self._sum += seconds

    def snapshot(self) -> LatencySnapshot:
        running, cumulative = 0, []
        for count in self._counts:
            running += count
            cumulative.append(running)
        return LatencySnapshot(self._buckets, tuple(cumulative), self._sum, running)


@dataclass(frozen=True)
class TierSnapshot:
    """Everything the metrics endpoint needs about one tier, at one instant."""

    name: str
    health: str
    last_error: str | None  # the most recent failure, kept after recovery
    capacity_bytes: int
    usage_bytes: int
    entries: int
    chunk_tokens: int
    counters: dict[str, int]
    get_latency: LatencySnapshot
    put_latency: LatencySnapshot

    @property
    def hit_tokens(self) -> int:
        return self.counters["hits"] * self.chunk_tokens

    @property
    def miss_tokens(self) -> int:
        return self.counters["misses"] * self.chunk_tokens

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update(self.counters, hit_tokens=self.hit_tokens, miss_tokens=self.miss_tokens)
        del out["counters"]
        return out


class CounterSet:
    """Thread-safe named integer counters: `add(hits=1, bytes_read=n)`."""

    def __init__(self, fields: tuple[str, ...]) -> None:
        self._lock = threading.Lock()
        self._values = dict.fromkeys(fields, 0)

    def add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._values[name] += delta

    def __getitem__(self, name: str) -> int:
        return self._values[name]

    def values(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class TierCounters(CounterSet):
    """The counters of one tier plus its get and put latency histograms."""

    def __init__(self) -> None:
        super().__init__(COUNTER_FIELDS)
        self._get = LatencyHistogram()
        self._put = LatencyHistogram()

    def observe_get(self, seconds: float) -> None:
        with self._lock:
            self._get.observe(seconds)

    def observe_put(self, seconds: float) -> None:
        with self._lock:
            self._put.observe(seconds)

    def latencies(self) -> tuple[LatencySnapshot, LatencySnapshot]:
        with self._lock:
            return self._get.snapshot(), self._put.snapshot()
