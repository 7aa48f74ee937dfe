"""KV events of a real `kvtier serve`: what the store finishes while the server idles (a
disk write behind the last request) is published without waiting for another request."""

from __future__ import annotations

import httpx

from tests.kv_event_subscriber import Subscriber
from tests.server.server_helpers import ServerProcess, server_flags

EVENTS = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:*", "replay_endpoint": "tcp://*:*"}'


def test_an_idle_server_publishes_the_writes_behind_its_last_request(model_path, tmp_path):
    server = ServerProcess(*server_flags(model_path, "--kv-offload", "disk", "--kv-offload-disk-path",
                                         str(tmp_path / "kv"), "--kv-chunk-tokens", "32", "--kv-events-config",
                                         EVENTS))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            events = client.get("/instance").json()["kv_events"]
            host = "tcp://127.0.0.1:"
            subscriber = Subscriber(host + events["endpoint"].rsplit(":", 1)[1],
                                    host + events["replay_endpoint"].rsplit(":", 1)[1])
            body = {"model": "tiny", "prompt": list(range(1, 100)), "max_tokens": 1, "temperature": 0}
            assert client.post("/v1/completions", json=body).status_code == 200
            assert len(subscriber.wait_for("DISK", blocks=96 // 16, timeout_s=60)) == 96 // 16
            subscriber.close()
    finally:
        server.stop()
