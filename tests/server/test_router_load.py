"""The router's view of an instance's load (engine/router/workers.py, policies.py): the
waiting requests an instance reports count once, and not the router's own."""

from __future__ import annotations

from engine.router.policies import load
from engine.router.workers import Worker, WorkerPool

METRICS = """# HELP vllm:num_requests_waiting Requests waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{model_name="tiny"}} {waiting}
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{model_name="tiny"}} 0.25
"""


def test_a_request_the_router_sent_counts_once_while_it_waits_and_not_after():
    worker = Worker("http://127.0.0.1:1", in_flight=1)
    WorkerPool._read_load(worker, METRICS.format(waiting=1))  # read while the router's request waited
    assert load(worker) == 1 and worker.kv_usage == 0.25
    worker.in_flight = 0  # it finished before the next check
    assert load(worker) == 0


def test_requests_other_clients_sent_count():
    worker = Worker("http://127.0.0.1:1", in_flight=1)
    WorkerPool._read_load(worker, METRICS.format(waiting=3))
    assert load(worker) == 3


def test_only_the_load_gauges_are_read_from_a_full_metrics_page():
    lookalikes = (
        '# TYPE vllm:num_requests_waiting_total counter\n'
        'vllm:num_requests_waiting_total{model_name="tiny"} 40\n'
        'vllm:kv_cache_usage_perc_max 0.9\n'
        'vllm:e2e_request_latency_seconds_bucket{le="0.3",model_name="tiny"} 7\n'
    )
    worker = Worker("http://127.0.0.1:1")
    WorkerPool._read_load(worker, lookalikes + METRICS.format(waiting=2) + 'vllm:num_requests_running 5\n')
    assert worker.waiting == 2 and worker.kv_usage == 0.25
