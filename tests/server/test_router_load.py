"""The router's view of an instance's load (engine/router/workers.py, policies.py): the
waiting requests an instance reports count once, and not the router's own; and what an
instance reports on GET /load."""

from __future__ import annotations

import time

from engine.router.policies import load
from engine.router.workers import Worker, WorkerPool
from engine.server.instance_info import InstanceLoad, instance_load


def report(waiting: int) -> InstanceLoad:
    """An instance's /load answer with `waiting` requests waiting."""
    return InstanceLoad(instance_id="a", server_load=waiting, num_requests_running=0,
                        num_requests_waiting=waiting, kv_cache_usage_perc=0.25)


def test_a_request_the_router_sent_counts_once_while_it_waits_and_not_after():
    worker = Worker("http://127.0.0.1:1", in_flight=1)
    WorkerPool._read_load(worker, report(waiting=1))  # read while the router's request waited
    assert load(worker) == 1 and worker.kv_usage == 0.25
    worker.in_flight = 0  # it finished before the next check
    assert load(worker) == 0


def test_requests_other_clients_sent_count():
    worker = Worker("http://127.0.0.1:1", in_flight=1)
    WorkerPool._read_load(worker, report(waiting=3))
    assert load(worker) == 3


def test_load_counts_running_and_waiting_requests_from_the_engines_stats():
    stats = {"num_requests_running": 2, "num_requests_waiting": 3, "kv_cache_usage_perc": 0.5, "num_kv_blocks": 9}
    load = instance_load("abc", stats)
    assert (load.server_load, load.num_requests_running, load.num_requests_waiting) == (5, 2, 3)
    assert load.kv_cache_usage_perc == 0.5 and load.instance_id == "abc"
    assert instance_load("abc", {}).server_load == 0  # an engine that has not published yet


def test_an_idle_instance_reports_no_load_and_its_instance_id(http):
    instance_id = http.get("/instance").json()["instance_id"]
    deadline = time.monotonic() + 60  # a request of an earlier test may still be finishing
    while (answer := http.get("/load").json())["server_load"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answer == {"instance_id": instance_id, "server_load": 0, "num_requests_running": 0,
                      "num_requests_waiting": 0, "kv_cache_usage_perc": 0.0}
