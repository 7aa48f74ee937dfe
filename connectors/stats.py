"""The connector's counters as flat `kv_*` engine stats, and the per-tier store view
that the server exports (`kv_tiers`, contract in engine/server/metrics.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from connectors.planner import PlannerCounters
from connectors.worker import WorkerCounters


def connector_stats(
    planner: PlannerCounters, worker: WorkerCounters, saved: tuple[int, int, int], tiers: Sequence[str]
) -> dict[str, int | float]:
    """`saved`: (records saved after a step, records saved for a preempted request,
    records skipped for want of a free slot)."""
    saved_chunks, offloaded_chunks, skipped_chunks = saved
    stats: dict[str, int | float] = {
        f"kv_external_hit_tokens_{tier}": worker.loaded_tokens_by_tier.get(tier, 0) for tier in tiers
    }
    stats.update(
        kv_loaded_tokens=worker.loaded_tokens,
        kv_async_loads=planner.async_loads,
        kv_load_failures=planner.load_failures,
        kv_load_failed_tokens=planner.load_failed_tokens,
        kv_saved_chunks=saved_chunks,
        kv_save_skipped_chunks=skipped_chunks,
        kv_offloaded_chunks=offloaded_chunks,
        kv_prefetched_requests=planner.prefetched_requests,
        kv_load_copy_seconds=worker.load_copy_seconds,
        kv_save_copy_seconds=worker.save_copy_seconds,
    )
    return stats


def tier_view(snapshot: Any, hit_tokens: int) -> dict[str, Any]:
    """One tier of a kvstore StoreSnapshot in the server's `kv_tiers` shape: every tier
    counter, token counts, usage, health, and get/put latencies as load/save histograms.

    `hit_tokens` is the worker's count of prompt tokens loads copied into requests from
    records that came from this tier (`kv_external_hit_tokens_<tier>`), not the
    snapshot's records x chunk size: a load takes the blocks of a record from its first
    one not on the device, and a record a prefetch read counts for the tier it came from,
    so one definition serves kvtier:store_hit_tokens and kvtier:external_hit_tokens."""
    view: dict[str, Any] = dict(snapshot.counters)
    view.update(
        hit_tokens=hit_tokens,
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
