"""The router's view of an instance's load (engine/router/workers.py, policies.py): the
waiting requests an instance reports count once, and not the router's own; and what an
instance reports on GET /load."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx

from engine.router.policies import load
from engine.router.workers import Worker, WorkerPool
from engine.server.instance_info import InstanceLoad
from tests.server.server_helpers import MAX_MODEL_LEN, MODEL_NAME


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


def _load_when(http: httpx.Client, ready: Callable[[dict], bool], timeout_s: float = 60) -> dict:
    """The first /load answer that `ready` accepts (the engine publishes its load after each step)."""
    deadline = time.monotonic() + timeout_s
    while True:
        answer = http.get("/load")
        assert answer.status_code == 200
        load = answer.json()
        if ready(load) or time.monotonic() > deadline:
            return load
        time.sleep(0.005)


def test_load_reports_the_running_request_and_the_instance(http):
    instance_id = http.get("/instance").json()["instance_id"]
    idle = _load_when(http, lambda load: load["server_load"] == 0)
    assert idle["server_load"] == 0 and idle["instance_id"] == instance_id
    body = {"model": MODEL_NAME, "prompt": [1, 2, 3], "max_tokens": MAX_MODEL_LEN - 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        assert stream.status_code == 200
        next(stream.iter_lines())  # the request runs
        busy = _load_when(http, lambda load: load["num_requests_running"] == 1)
    assert busy["num_requests_running"] == 1 and busy["num_requests_waiting"] == 0
    assert busy["server_load"] == 1 and 0 < busy["kv_cache_usage_perc"] <= 1
    # the client left: the request is aborted and the load goes back to nothing
    assert _load_when(http, lambda load: load["server_load"] == 0)["server_load"] == 0
