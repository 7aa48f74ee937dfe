"""A shared tier that does not answer: a start-up warning naming its URL, /health says
"degraded" (still 200: the process is alive), /ready answers 503 until Redis is back when
--ready-requires-tiers names it (tests/server/test_ready_tiers.py: the default), and
the tier recovers by itself. Store option errors name the flag to blame."""

from __future__ import annotations

import time

import httpx
import pytest

from bench.redis_server import RedisServer
from tests.server.server_helpers import EAGER_OPS, ServerProcess

RECOVERY_TIMEOUT_S = 30  # the probe's backoff is at most 8 s


def test_redis_down_at_start_is_degraded_then_recovers(model_path, redis_binary, tmp_path):
    """Also the /ready of --ready-requires-tiers naming a tier that does not answer
    (tests/server/test_ready_tiers.py has the default's)."""
    redis = RedisServer(redis_binary, tmp_path / "redis")  # its port chosen, not started yet
    process = ServerProcess(
        "--model", model_path, "--num-kv-blocks", "32", "--kv-offload", "cpu,redis",
        "--kv-redis-url", redis.url, "--kv-offload-cpu-size", "16MiB", "--kv-chunk-tokens", "32",
        "--log-level", "warning", EAGER_OPS, "--ready-requires-tiers", "cpu,redis",
    )
    try:
        assert f"the redis tier at {redis.url} does not answer" in process.output
        health = httpx.get(process.url + "/health")
        assert health.status_code == 200
        assert health.json() == {"status": "degraded", "kv_tiers": {"cpu": "healthy", "redis": "unhealthy"},
                                 "unhealthy_tiers": ["redis"]}
        ready = httpx.get(process.url + "/ready")
        assert ready.status_code == 503 and ready.json()["status"] == "degraded"
        assert ready.json()["ready_requires_tiers"] == ["cpu", "redis"]
        assert ready.json()["unhealthy_tiers"] == ["redis"]
        # requests are still served, without the shared tier
        reply = httpx.post(process.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2})
        assert reply.status_code == 200

        redis.start()
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while httpx.get(process.url + "/ready").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(process.url + "/ready").status_code == 200
        assert httpx.get(process.url + "/health").json()["status"] == "ok"
    finally:
        process.stop()
        redis.kill()


def test_a_disk_path_that_cannot_be_created_names_its_flag(model_path, tmp_path, capsys):
    """`kvtier generate` in this process (its imports are done here already)."""
    from engine.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as exited:  # any other exception would be the traceback
        main(["generate", "--prompt", "hi", "--model", model_path, "--num-kv-blocks", "16",
              "--kv-offload", "cpu,disk", "--kv-offload-cpu-size", "16MiB",
              "--kv-offload-disk-path", str(blocker / "kv")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "kvtier generate: error: --kv-offload-disk-path: cannot create disk tier directory" in err


def test_a_cpu_tier_larger_than_memory_names_its_flag(model_path):
    from engine import LLM
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"^kv_offload_cpu_size: cannot allocate \d+ bytes of host memory") as error:
        LLM(model=model_path, num_kv_blocks=16, kv_offload="cpu", kv_offload_cpu_size="1048576GiB")
    assert error.value.option == "kv_offload_cpu_size"


def test_a_cpu_tier_too_small_for_a_chunk_names_its_flag(model_path):
    from engine import LLM
    from engine.config import ConfigError

    with pytest.raises(ConfigError, match=r"^kv_offload_cpu_size: cpu tier of 1024 bytes") as error:
        LLM(model=model_path, num_kv_blocks=16, kv_offload="cpu", kv_offload_cpu_size="1024B")
    assert error.value.option == "kv_offload_cpu_size"
