"""/metrics (names, parsing, counters moving), aborts on client disconnect freeing
blocks, and the KV admin API's authentication and endpoints."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.server.server_helpers import (
    ADMIN_TOKEN,
    MODEL_NAME,
    scrape,
    value,
)

pytestmark = pytest.mark.timeout(60)

VLLM_METRICS = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}
KVTIER_TIER_METRICS = {
    "kvtier:store_hit_tokens": "counter",
    "kvtier:store_miss_tokens": "counter",
    "kvtier:store_read_bytes": "counter",
    "kvtier:store_written_bytes": "counter",
    "kvtier:store_evictions": "counter",
    "kvtier:store_errors": "counter",
    "kvtier:store_checksum_failures": "counter",
    "kvtier:store_rejected_records": "counter",
    "kvtier:store_usage_bytes": "gauge",
    "kvtier:store_capacity_bytes": "gauge",
    "kvtier:store_healthy": "gauge",
    "kvtier:store_load_latency_seconds": "histogram",
    "kvtier:store_save_latency_seconds": "histogram",
}
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def wait_idle(http: httpx.Client, timeout: float = 10.0) -> dict:
    """The metrics once no request runs or waits and no device block is held."""
    deadline = time.monotonic() + timeout
    while True:
        families = scrape(http)
        busy = (value(families, "vllm:num_requests_running") + value(families, "vllm:num_requests_waiting")
                + value(families, "vllm:kv_cache_usage_perc"))
        if busy == 0:
            return families
        assert time.monotonic() < deadline, "requests or blocks still held"
        time.sleep(0.05)


def test_metrics_parse_with_vllm_and_kvtier_names(http):
    families = scrape(http)
    for name, kind in {**VLLM_METRICS, **KVTIER_TIER_METRICS}.items():
        assert families[name].type == kind, name
    for name in KVTIER_TIER_METRICS:
        tiers = {s.labels["tier"] for s in families[name].samples}
        assert tiers == {"cpu"}, name
    reasons = {s.labels["reason"] for s in families["kvtier:store_rejected_records"].samples}
    assert reasons == {"checksum", "hmac", "identity"}


def test_counters_and_histograms_move_with_a_request(http):
    before = wait_idle(http)
    response = http.post("/v1/completions", json={
        "model": MODEL_NAME, "prompt": "counting tokens", "max_tokens": 7, "ignore_eos": True,
    })
    usage = response.json()["usage"]
    after = wait_idle(http)

    def delta(name, sample=None, **labels):
        return value(after, name, sample, **labels) - value(before, name, sample, **labels)

    assert delta("vllm:generation_tokens") == usage["completion_tokens"] == 7
    assert delta("vllm:prompt_tokens") == usage["prompt_tokens"]
    assert delta("vllm:request_success", finished_reason="length") == 1
    assert delta("vllm:prefix_cache_queries") >= usage["prompt_tokens"]
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds"):
        assert delta(name, name + "_count") == 1
    assert delta("vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count") == 6


def test_disconnecting_stream_aborts_and_frees_its_blocks(http, server):
    before = wait_idle(http)
    body = {"model": MODEL_NAME, "prompt": "a long answer please", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        first_events = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in first_events)
        running = scrape(http)
        assert value(running, "vllm:num_requests_running") == 1
        assert value(running, "vllm:kv_cache_usage_perc") > 0
    after = wait_idle(http)
    assert value(after, "vllm:request_success", finished_reason="abort") == value(
        before, "vllm:request_success", finished_reason="abort") + 1
    generated = value(after, "vllm:generation_tokens") - value(before, "vllm:generation_tokens")
    assert 0 < generated < 200
    device = http.get("/kv/stats", headers=AUTH).json()["device"]
    assert device["kv_cache_usage_perc"] == 0 and device["num_requests_running"] == 0


def test_disconnecting_non_streaming_client_aborts_its_request(http, server):
    before = wait_idle(http)
    body = json.dumps({"model": MODEL_NAME, "prompt": "never read", "max_tokens": 240, "ignore_eos": True})
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as client:
        client.sendall(request)
        deadline = time.monotonic() + 10
        while value(scrape(http), "vllm:num_requests_running") != 1:
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    after = wait_idle(http)
    assert value(after, "vllm:request_success", finished_reason="abort") == value(
        before, "vllm:request_success", finished_reason="abort") + 1
    assert value(after, "vllm:generation_tokens") - value(before, "vllm:generation_tokens") < 240


@pytest.mark.parametrize("headers", [
    {}, {"Authorization": "Bearer"}, {"Authorization": "Bearer wrong-token-0123456789"},
    {"Authorization": f"Basic {ADMIN_TOKEN}"}, {"Authorization": ADMIN_TOKEN},
    {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
])
@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/kv/stats"), ("POST", "/kv/pin"), ("POST", "/kv/unpin"), ("POST", "/kv/flush"),
])
def test_admin_refuses_missing_or_wrong_tokens(http, headers, method, path):
    response = http.request(method, path, headers=headers, content=b"{not json")
    assert response.status_code == 401
    assert response.headers["www-authenticate"] == "Bearer"
    assert response.json()["error"]["type"] == "authentication_error"


def test_admin_stats_report_device_and_tiers(http):
    stats = http.get("/kv/stats", headers=AUTH).json()
    assert stats["device"]["num_kv_blocks"] == 256
    assert {"kv_cache_usage_perc", "prefix_cache_hits", "prefix_cache_queries"} <= set(stats["device"])
    assert set(stats["tiers"]) == {"cpu"}


def test_admin_store_operations(http):
    prefix = list(range(3, 3 + 100))  # three full 32-token chunks
    pin = http.post("/kv/pin", headers=AUTH, json={"prompt": prefix, "ttl": 60})
    assert pin.status_code == 200, pin.text
    answer = pin.json()
    assert {key: answer[key] for key in ("ttl", "pinned_chunks", "pinned_tokens", "prompt_tokens", "prompt_format")} \
        == {"ttl": 60, "pinned_chunks": 3, "pinned_tokens": 96, "prompt_tokens": 100, "prompt_format": "token_ids"}
    unpin = http.post("/kv/unpin", headers=AUTH, json={"prompt": prefix})
    assert unpin.status_code == 200, unpin.text
    assert unpin.json()["unpinned_chunks"] >= 0
    chat = http.post("/kv/pin", headers=AUTH, json={"messages": [{"role": "system", "content": "x" * 80}]})
    assert chat.status_code == 200, chat.text
    flush = http.post("/kv/flush", headers=AUTH, json={"tiers": ["cpu"]})
    assert flush.status_code == 200, flush.text
    assert "flushed_chunks" in flush.json()


@pytest.mark.timeout(300)  # its setup may start the storeless server, which takes minutes on a loaded host
def test_store_operations_answer_501_without_a_store(storeless_server):
    url = storeless_server.url
    for path, body in (("/kv/pin", {"prompt": "abc"}), ("/kv/unpin", {"prompt": "abc"}), ("/kv/flush", {})):
        response = httpx.post(url + path, headers=AUTH, json=body)
        assert response.status_code == 501
        error = response.json()["error"]
        assert error["message"] == "not available: no KV store configured"
        assert error["code"] == "kv_store_unavailable"
    stats = httpx.get(url + "/kv/stats", headers=AUTH).json()
    assert stats["store"] is None and stats["tiers"] == {}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/kv/pin", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, None),
    ("/kv/pin", {}, None),
    ("/kv/pin", {"prompt": "x", "ttl": -1}, "ttl"),
    ("/kv/flush", {"tiers": ["tape"]}, "tiers.0"),
    ("/kv/flush", {"tiers": ["disk"]}, "tiers"),
    # token ids outside the vocabulary: 2**32 and beyond do not fit the hash's uint32
    ("/kv/pin", {"prompt": [5, 2**32]}, "prompt"),
    ("/kv/unpin", {"prompt": [5, 2**32]}, "prompt"),
    ("/kv/pin", {"prompt": [5, 2**64]}, "prompt"),
    ("/kv/pin", {"prompt": [5, 10**6]}, "prompt"),
    ("/kv/unpin", {"prompt": [-1]}, "prompt"),
    ("/kv/pin", {"prompt": [1, True]}, "prompt"),
])
def test_admin_validates_bodies_after_authentication(http, path, body, param):
    response = http.post(path, headers=AUTH, json=body)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == param
