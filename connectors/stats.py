"""The connector's counters (flat `kv_*` engine stats) and the per-tier store view that
the server exports (`kv_tiers`, contract in engine/server/metrics.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ConnectorCounters:
    """Updated on the engine thread only."""

    loaded_tokens: int = 0
    loaded_tokens_by_tier: Counter[str] = field(default_factory=Counter)
    async_loads: int = 0
    load_failures: int = 0  # loads that delivered fewer tokens than the lookup promised
    load_failed_tokens: int = 0  # promised tokens that were recomputed instead
    saved_chunks: int = 0
    save_skipped_chunks: int = 0  # no staging buffer was free
    offloaded_chunks: int = 0  # saved because their request was preempted
    prefetched_requests: int = 0
    load_copy_seconds: float = 0.0  # host staging -> device blocks
    save_copy_seconds: float = 0.0  # device blocks -> host staging -> store (cpu copy)

    def as_stats(self, tiers: Sequence[str]) -> dict[str, int | float]:
        stats: dict[str, int | float] = {
            f"kv_external_hit_tokens_{tier}": self.loaded_tokens_by_tier[tier] for tier in tiers
        }
        stats.update(
            kv_loaded_tokens=self.loaded_tokens,
            kv_async_loads=self.async_loads,
            kv_load_failures=self.load_failures,
            kv_load_failed_tokens=self.load_failed_tokens,
            kv_saved_chunks=self.saved_chunks,
            kv_save_skipped_chunks=self.save_skipped_chunks,
            kv_offloaded_chunks=self.offloaded_chunks,
            kv_prefetched_requests=self.prefetched_requests,
            kv_load_copy_seconds=self.load_copy_seconds,
            kv_save_copy_seconds=self.save_copy_seconds,
        )
        return stats


def tier_view(snapshot: Any) -> dict[str, Any]:
    """One tier of a kvstore StoreSnapshot in the server's `kv_tiers` shape: every tier
    counter, token counts, usage, health, and get/put latencies as load/save histograms."""
    view: dict[str, Any] = dict(snapshot.counters)
    view.update(
        hit_tokens=snapshot.hit_tokens,
        miss_tokens=snapshot.miss_tokens,
        usage_bytes=snapshot.usage_bytes,
        capacity_bytes=snapshot.capacity_bytes,
        entries=snapshot.entries,
        health=snapshot.health,
        healthy=snapshot.health == "healthy",
        load_latency=_histogram(snapshot.get_latency),
        save_latency=_histogram(snapshot.put_latency),
    )
    return view


def _histogram(latency: Any) -> dict[str, Any]:
    """Cumulative bucket counts keyed by upper bound; the last (+Inf) count is `count`."""
    buckets = dict(zip(latency.buckets_s, latency.cumulative_counts, strict=False))
    return {"sum": latency.sum_s, "count": latency.count, "buckets": buckets}
