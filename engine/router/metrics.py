"""The router's /metrics (Prometheus): decisions per policy and instance, the cached
tokens it predicted against those the instance reported (usage.prompt_tokens_details of
non-streamed answers), retries, the router's own time per request, and each instance's
health, load and indexed blocks."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from engine.router.fleet_index import FleetIndex
from engine.router.policies import load
from engine.router.workers import Worker

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# the router's own work on a request is a millisecond or two: buckets fine enough to tell
ROUTING_BUCKETS = (0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1)


class RouterMetrics:
    def __init__(self, workers: Callable[[], list[Worker]], index: FleetIndex) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.decisions = Counter("kvtier:router_decisions", "Requests routed, by policy and instance.",
                                 ["policy", "instance"], registry=self.registry)
        self.predicted_cached = Counter(
            "kvtier:router_predicted_cached_tokens", "Prompt tokens the router expected the chosen instance "
            "to hold (device) or load (its tiers, the shared store).", ["instance", "where"], registry=self.registry)
        self.reported_cached = Counter(
            "kvtier:router_reported_cached_tokens", "Cached prompt tokens instances reported in "
            "non-streamed answers.", ["instance"], registry=self.registry)
        self.retries = Counter("kvtier:router_retries", "Requests sent to a second instance after the first "
                               "failed before its first byte.", registry=self.registry)
        self.routing = Histogram(
            "kvtier:router_routing_seconds", "The router's own time on a forwarded request before it is sent: "
            "reading its JSON, tokenizing and hashing its prompt, ranking the instances (a disaggregated "
            "request's prefill not included).", buckets=ROUTING_BUCKETS, registry=self.registry)
        self.unrouted = Counter("kvtier:router_unrouted", "Requests answered 503: no instance in the pool.",
                                registry=self.registry)
        self.registry.register(_InstanceGauges(workers, index))
        self.up = Gauge("kvtier:router_up", "1 while the router runs.", registry=self.registry)
        self.up.set(1)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _InstanceGauges(Collector):
    """Read at scrape time from the pool and the index."""

    def __init__(self, workers: Callable[[], list[Worker]], index: FleetIndex) -> None:
        self._workers = workers
        self._index = index

    def collect(self) -> Iterator[GaugeMetricFamily]:
        healthy = GaugeMetricFamily("kvtier:router_instance_healthy", "1 while the instance is in the pool.",
                                    labels=["instance"])
        loads = GaugeMetricFamily("kvtier:router_instance_load", "Requests the router has in flight on the "
                                  "instance plus those the instance reported waiting.", labels=["instance"])
        usage = GaugeMetricFamily("kvtier:router_instance_kv_usage", "The instance's reported KV cache usage.",
                                  labels=["instance"])
        blocks = GaugeMetricFamily("kvtier:router_instance_indexed_blocks", "Blocks the router knows the "
                                   "instance holds outside the shared store.", labels=["instance"])
        for worker in self._workers():
            healthy.add_metric([worker.url], 1.0 if worker.healthy else 0.0)
            loads.add_metric([worker.url], load(worker))
            usage.add_metric([worker.url], worker.kv_usage)
            blocks.add_metric([worker.url], self._index.size(worker.url))
        yield from (healthy, loads, usage, blocks)
