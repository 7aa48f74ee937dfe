"""`/ready` and a shared Redis that does not answer (issue 44, item 15): by default only the
local tiers decide readiness, so a Redis outage leaves every instance that shares it in
rotation (it is reported in the body); `--ready-requires-tiers` names the tiers that must
answer (its 503: tests/server/test_tier_health.py, on the server that then sees Redis
come back). A real redis-server that is never started: it does not answer."""

from __future__ import annotations

import httpx
import pytest

from bench.redis_server import RedisServer
from engine.config import ConfigError, ServerConfig
from tests.server.server_helpers import EAGER_OPS, ServerProcess


def _serve_without_redis(model_path: str, redis: RedisServer) -> ServerProcess:
    return ServerProcess(
        "--model", model_path, "--num-kv-blocks", "32", "--kv-offload", "cpu,redis",
        "--kv-redis-url", redis.url, "--kv-offload-cpu-size", "16MiB", "--kv-chunk-tokens", "32",
        "--log-level", "warning", EAGER_OPS,
    )


def test_a_shared_redis_down_leaves_the_instance_ready_by_default(model_path, redis_binary, tmp_path):
    redis = RedisServer(redis_binary, tmp_path / "redis")  # its port chosen, not started
    process = _serve_without_redis(model_path, redis)
    try:
        ready = httpx.get(process.url + "/ready", timeout=60)
        assert ready.status_code == 200, ready.text
        assert ready.json() == {"status": "degraded", "kv_tiers": {"cpu": "healthy", "redis": "unhealthy"},
                                "unhealthy_tiers": ["redis"], "ready_requires_tiers": ["cpu"]}
        reply = httpx.post(process.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
        assert reply.status_code == 200
    finally:
        process.stop()


@pytest.mark.parametrize(("value", "tiers"), [(None, None), ("none", ()), ("redis,cpu", ("cpu", "redis"))])
def test_the_option_takes_a_tier_list_or_none(value, tiers):
    assert ServerConfig(ready_requires_tiers=value).ready_requires_tiers == tiers


def test_an_unknown_tier_is_a_one_line_error_naming_the_option():
    with pytest.raises(ConfigError) as error:
        ServerConfig(ready_requires_tiers="tape")
    assert error.value.option == "ready_requires_tiers"
    assert "tape" in str(error.value) and "\n" not in str(error.value)
