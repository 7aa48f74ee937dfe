"""Prometheus metrics at /metrics.

- Request metrics under vLLM's names (`vllm:` prefix, so existing dashboards work),
  observed on the engine thread as outputs are produced (`RequestMetrics`).
- Engine gauges and counters read at scrape time from the stats snapshot the engine
  thread publishes (`EngineStatsCollector`), the connector's `kv_*` counters included.
- `kvtier:store_*` metrics per offload tier, read at scrape time from the snapshot's
  `kv_tiers` entry (`TierStatsCollector`); `kvtier:store_rejected_records` counts the
  records each tier refused, by reason (REJECTION_REASONS). Its contract, one dict per
  tier name:

      hit_tokens, miss_tokens, bytes_read, bytes_written, evictions, errors,
      checksum_failures, auth_failures, rejected_records,
      probe_timeouts                                      cumulative counts (int)
      usage_bytes, capacity_bytes                         gauges (int)
      healthy                                             bool
      load_latency, save_latency    {"sum": seconds, "count": n,
                                     "buckets": {upper_bound_seconds: cumulative_count}}

  Missing fields read zero; until a store reports, every configured tier reads zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from engine.outputs import RequestOutput

StatsSource = Callable[[], Mapping[str, Any]]

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
               0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                           15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000,
                 50000, 100000)

# engine stats key -> (metric name, help)
ENGINE_GAUGES = {
    "num_requests_running": ("vllm:num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("vllm:num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc",
                            "Fraction of device KV blocks held by requests (1 = full)."),
    "num_kv_blocks": ("kvtier:device_kv_blocks", "Blocks in the device KV pool."),
}
ENGINE_COUNTERS = {
    "num_preemptions_total": ("vllm:num_preemptions", "Preemptions of running requests."),
    "prefix_cache_queries": ("vllm:prefix_cache_queries",
                             "Prompt tokens looked up in the device prefix cache."),
    "prefix_cache_hits": ("vllm:prefix_cache_hits",
                          "Prompt tokens found in the device prefix cache."),
}
# the connector's flat `kv_*` engine stats (cumulative)
CONNECTOR_COUNTERS = {
    "kv_loaded_tokens": ("kvtier:loaded_tokens", "Prompt tokens loaded from the store instead of computed."),
    "kv_async_loads": ("kvtier:async_loads", "Loads from disk or redis done while other requests ran."),
    "kv_load_failures": ("kvtier:load_failures", "Loads that delivered fewer tokens than promised."),
    "kv_load_failed_tokens": ("kvtier:load_failed_tokens", "Promised tokens recomputed instead."),
    "kv_saved_chunks": ("kvtier:saved_chunks", "Chunks handed to the store to save."),
    "kv_save_skipped_chunks": ("kvtier:save_skipped_chunks", "Chunks not saved: no host slot free."),
    "kv_offloaded_chunks": ("kvtier:offloaded_chunks", "Chunks saved because their request was preempted."),
    "kv_prefetched_requests": ("kvtier:prefetched_requests", "Queued requests whose chunks were prefetched."),
    "kv_load_copy_seconds": ("kvtier:load_copy_seconds", "Time copying loaded KV into device blocks."),
    "kv_save_copy_seconds": ("kvtier:save_copy_seconds", "Time copying device KV out for saving."),
}
EXTERNAL_HIT_PREFIX = "kv_external_hit_tokens_"  # + tier name
# the blender's flat `kv_blend_*` engine stats (cumulative; engine/blend)
BLEND_COUNTERS = {
    "kv_blend_requests": ("kvtier:blend_requests", "Requests whose prompt was blended from stored segments."),
    "kv_blend_stored_requests": ("kvtier:blend_stored_requests",
                                 "Segmented requests served from the store's KV of their prompt, not blended."),
    "kv_blend_prompt_tokens": ("kvtier:blend_prompt_tokens", "Prompt tokens of blended requests."),
    "kv_blend_prefix_hit_tokens": ("kvtier:blend_prefix_hit_tokens",
                                   "Blended prompt tokens found as a prefix (exact, or the same blend)."),
    "kv_blend_recomputed_tokens": ("kvtier:blend_recomputed_tokens",
                                   "Blended prompt tokens computed in context (selected, not stored, the question)."),
    "kv_blend_segment_prefills": ("kvtier:blend_segment_prefills",
                                  "Segments prefilled alone (computed, or loaded from the store) for blending."),
}
BLEND_REUSED_PREFIX = "kv_blend_reused_tokens_"  # + where the segment's KV was: device, a tier, computed
TIER_COUNTERS = {
    "hit_tokens": ("kvtier:store_hit_tokens",
                   "Prompt tokens loaded into requests from records that came from the tier (a record "
                   "prefetched into cpu counts for the tier it was read from); the same count as "
                   "kvtier:external_hit_tokens."),
    "miss_tokens": ("kvtier:store_miss_tokens", "Tokens of records asked of the tier that it did not deliver."),
    "bytes_read": ("kvtier:store_read_bytes", "Bytes read from the tier."),
    "bytes_written": ("kvtier:store_written_bytes", "Bytes written to the tier."),
    "evictions": ("kvtier:store_evictions", "Chunks evicted from the tier."),
    "errors": ("kvtier:store_errors", "Failed tier operations (the tokens were recomputed)."),
    "checksum_failures": ("kvtier:store_checksum_failures",
                          "Records rejected as damaged: truncated, bad magic or xxh3 checksum mismatch."),
    "probe_timeouts": ("kvtier:store_probe_timeouts",
                       "Probes of the tier's block index that took longer than --kv-lookup-timeout: "
                       "what they asked about counted as absent and was recomputed."),
}
# tier counter -> `reason` of kvtier:store_rejected_records (every record a tier refused)
# (the store counts fingerprint, key, version and layout mismatches as one: "identity")
REJECTION_REASONS = {
    "checksum_failures": "checksum",  # truncated, bad magic, xxh3 mismatch
    "auth_failures": "hmac",  # unsigned while --kv-secret is set, or signed with another secret
    "rejected_records": "identity",  # another model, another key (a moved record), version, layout
}
REJECTED_RECORDS = ("kvtier:store_rejected_records",
                    "Records a tier refused to use (each one a miss, recomputed), by reason: checksum "
                    "(damaged), hmac (--kv-secret verification failed), identity (another model, another "
                    "key, format version or layout).")
TIER_GAUGES = {
    "usage_bytes": ("kvtier:store_usage_bytes", "Bytes held by the tier."),
    "capacity_bytes": ("kvtier:store_capacity_bytes", "Byte budget of the tier."),
    "healthy": ("kvtier:store_healthy", "1 when the tier answers, 0 when it does not."),
}
TIER_HISTOGRAMS = {
    "load_latency": ("kvtier:store_load_latency_seconds", "Latency of loads from the tier."),
    "save_latency": ("kvtier:store_save_latency_seconds", "Latency of saves to the tier."),
}


class RequestMetrics:
    """Per-request latency and token metrics; a StepObserver, so it runs on the engine
    thread only and its per-request state needs no lock."""

    def __init__(self, model_name: str, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, buckets: Sequence[float]):
            return Histogram(name, doc, ["model_name"], buckets=buckets, registry=registry).labels(model_name)

        def counter(name: str, doc: str):
            return Counter(name, doc, ["model_name"], registry=registry).labels(model_name)

        self._model_name = model_name
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Time from arrival to the first output token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Time between consecutive output tokens of a request.", ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Time from arrival to the last output token.", REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Time from arrival to the first scheduling.", REQUEST_LATENCY_BUCKETS)
        self.prompt_len = histogram("vllm:request_prompt_tokens",
                                    "Prompt tokens of finished requests.", TOKEN_BUCKETS)
        self.output_len = histogram("vllm:request_generation_tokens",
                                    "Output tokens of finished requests.", TOKEN_BUCKETS)
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Output tokens generated.")
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                ["model_name", "finished_reason"], registry=registry)
        self._last_token_time: dict[str, float] = {}

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        for output in outputs:
            if output.new_token_ids:
                self._observe_tokens(output, now)
            if output.finished:
                self._observe_finished(output)

    def on_aborted(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._last_token_time.pop(request_id, None)
        self._success.labels(self._model_name, "abort").inc(len(request_ids))

    def _observe_tokens(self, output: RequestOutput, now: float) -> None:
        self.generation_tokens.inc(len(output.new_token_ids))
        last = self._last_token_time.get(output.request_id)
        if last is None:
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            if output.metrics.time_to_first_token is not None:
                self.ttft.observe(output.metrics.time_to_first_token)
        else:
            self.itl.observe(now - last)
        self._last_token_time[output.request_id] = now

    def _observe_finished(self, output: RequestOutput) -> None:
        self._last_token_time.pop(output.request_id, None)
        metrics = output.metrics
        if metrics.finish_time is not None:
            self.e2e.observe(metrics.finish_time - metrics.arrival_time)
        if metrics.queue_time is not None:
            self.queue.observe(metrics.queue_time)
        self.prompt_len.observe(len(output.prompt_token_ids))
        self.output_len.observe(len(output.outputs[0].token_ids))
        reason = output.outputs[0].finish_reason or "unknown"
        self._success.labels(self._model_name, reason).inc()


class EngineStatsCollector:
    """vLLM's engine gauges and counters, read from the published stats at scrape time."""

    def __init__(self, model_name: str, stats: StatsSource) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        for key, (name, doc) in ENGINE_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(stats.get(key, 0)))
            yield family
        for key, (name, doc) in (ENGINE_COUNTERS | CONNECTOR_COUNTERS | BLEND_COUNTERS).items():
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([self._model_name], float(stats.get(key, 0)))
            yield family
        family = CounterMetricFamily("kvtier:external_hit_tokens",
                                     "Prompt tokens loaded from each tier (the count of kvtier:store_hit_tokens).",
                                     labels=["model_name", "tier"])
        for key, count in stats.items():
            if key.startswith(EXTERNAL_HIT_PREFIX):
                family.add_metric([self._model_name, key.removeprefix(EXTERNAL_HIT_PREFIX)], float(count))
        yield family
        family = CounterMetricFamily(
            "kvtier:blend_reused_tokens", "Blended prompt tokens that kept their segment's stored KV, by where "
            "that KV was when the request came: device (cache), cpu, disk or redis (the tier its segment "
            "prefill loaded it from), computed (by its segment prefill).",
            labels=["model_name", "source"])
        for key, count in stats.items():
            if key.startswith(BLEND_REUSED_PREFIX):
                family.add_metric([self._model_name, key.removeprefix(BLEND_REUSED_PREFIX)], float(count))
        yield family


class TierStatsCollector:
    """`kvtier:store_*` per tier from the snapshot's `kv_tiers` (see the module docstring)."""

    def __init__(self, stats: StatsSource, configured_tiers: Sequence[str]) -> None:
        self._stats = stats
        self._configured = tuple(configured_tiers)

    def tiers(self) -> dict[str, Mapping[str, Any]]:
        reported = self._stats().get("kv_tiers") or {}
        return {name: reported.get(name, {}) for name in (*self._configured, *reported)}

    def collect(self) -> Iterator[Metric]:
        tiers = self.tiers()
        for key, (name, doc) in TIER_COUNTERS.items():
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, stats in tiers.items():
                family.add_metric([tier], float(stats.get(key, 0)))
            yield family
        family = CounterMetricFamily(*REJECTED_RECORDS, labels=["tier", "reason"])
        for tier, stats in tiers.items():
            for key, reason in REJECTION_REASONS.items():
                family.add_metric([tier, reason], float(stats.get(key, 0)))
        yield family
        for key, (name, doc) in TIER_GAUGES.items():
            family = GaugeMetricFamily(name, doc, labels=["tier"])
            for tier, stats in tiers.items():
                family.add_metric([tier], float(stats.get(key, 0)))
            yield family
        for key, (name, doc) in TIER_HISTOGRAMS.items():
            family = HistogramMetricFamily(name, doc, labels=["tier"])
            for tier, stats in tiers.items():
                buckets, total = _histogram(stats.get(key) or {})
                family.add_metric([tier], buckets, sum_value=total)
            yield family


def _histogram(data: Mapping[str, Any]) -> tuple[list[tuple[str, float]], float]:
    """Prometheus buckets (ascending, ending at +Inf) and sum from a tier's latency dict."""
    bounds = sorted((float(le), float(n)) for le, n in (data.get("buckets") or {}).items())
    buckets = [(repr(le), n) for le, n in bounds if math.isfinite(le)]
    buckets.append(("+Inf", float(data.get("count", 0))))
    return buckets, float(data.get("sum", 0.0))


class ServerMetrics:
    """The server's registry: request metrics, engine and tier collectors, rejections."""

    def __init__(self, model_name: str, configured_tiers: Sequence[str]) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.requests = RequestMetrics(model_name, self.registry)
        self._model_name = model_name
        self._tiers = configured_tiers
        self._rejected = Counter("kvtier:requests_rejected", "Requests refused before admission.",
                                 ["model_name", "reason"], registry=self.registry)

    def watch(self, stats: StatsSource) -> None:
        """Read engine and tier stats from `stats` (the engine thread's snapshot)."""
        self.registry.register(EngineStatsCollector(self._model_name, stats))
        self.registry.register(TierStatsCollector(stats, self._tiers))

    def count_rejection(self, reason: str) -> None:
        self._rejected.labels(self._model_name, reason).inc()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
