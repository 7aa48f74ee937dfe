"""Issue 44's scenarios of numbers and readiness: JSON integers past Python's 4,300-digit
conversion limit in any numeric field (item 4), a Redis block-index probe past the lookup
timeout (item 9), and a shared Redis outage behind a load balancer's /ready (item 15).
Real servers, real redis-server processes paused with SIGSTOP or killed."""

from __future__ import annotations

import json
import logging
import sys

import httpx
import pytest
from reliability_support import (
    CHUNK,
    ENGINE,
    ColdOracle,
    drive,
    random_prompts,
    tier,
    wait_until,
    wrong_outputs,
)
from scorecard import Scorecard

from bench.redis_server import RedisServer
from engine import LLM
from tests.server.server_helpers import EAGER_OPS, ServerProcess

pytestmark = pytest.mark.timeout(300)

HUGE = "9" * (sys.get_int_max_str_digits() + 1)
PROMPTS = random_prompts(4, 100, seed=44)
MAX_TOKENS = 4
LOADABLE = len(PROMPTS) * (100 - 1) // 16 * 16
UNHEALTHY_WITHIN_S = 60.0  # the tier notices a dead Redis at its next probe or operation


def _huge(body: dict, field: str) -> bytes:
    return json.dumps({**body, field: "__HUGE__"}).replace('"__HUGE__"', HUGE).encode()


def test_huge_json_integers_are_400s(fault_server, scorecard: Scorecard):
    """Before: json.loads raised a plain ValueError past 4,300 digits; 500 and two tracebacks."""
    completion = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    bodies = {f"completions {f}": ("/v1/completions", _huge(completion, f))
              for f in ("max_tokens", "n", "seed", "temperature", "top_p", "logprobs", "stop", "prompt")}
    bodies |= {f"chat {f}": ("/v1/chat/completions", _huge(chat, f))
               for f in ("max_tokens", "max_completion_tokens", "n", "seed", "top_logprobs", "messages")}
    logged = len(fault_server.output)
    with httpx.Client(base_url=fault_server.url, timeout=120) as http:
        statuses = {name: http.post(path, content=body, headers={"Content-Type": "application/json"}).status_code
                    for name, (path, body) in bodies.items()}
        health = http.get("/health").status_code
    tracebacks = fault_server.output[logged:].count("Traceback")
    scorecard.add("security", "JSON integers past 4,300 digits in numeric fields", requests=len(bodies),
                  faults=len(bodies), wrong_outputs=0, answered_400=sum(s == 400 for s in statuses.values()),
                  answered_500=sum(s == 500 for s in statuses.values()), tracebacks=tracebacks, health_after=health)
    assert set(statuses.values()) == {400}, statuses
    assert tracebacks == 0 and health == 200


def test_redis_probes_past_the_lookup_timeout_are_counted(
    model_path, cold: ColdOracle, redis_factory, scorecard: Scorecard, caplog
):
    """Before: a probe past the 100 ms lookup timeout made another instance's KV a silent
    miss (a full recompute), with a warning per request."""
    server = redis_factory()
    redis = {"kv_offload": "redis", "kv_redis_url": server.url, "kv_lookup_timeout": 30.0}
    with LLM(model=model_path, **ENGINE, **redis) as writer:
        drive(writer.engine, PROMPTS, MAX_TOKENS)
        assert writer.engine.connector.store.drain(60)
    # Redis's own timeout is long, so the tier stays healthy and only the probe's bound acts.
    reader_options = {**ENGINE, **redis, "kv_offload": "cpu,redis", "kv_offload_cpu_size": "64MiB",
                      "kv_lookup_timeout": 0.2, "kv_redis_op_timeout": 120.0}
    caplog.set_level(logging.WARNING, logger="kvstore")
    with LLM(model=model_path, **reader_options) as reader:
        server.pause()
        try:
            run = drive(reader.engine, PROMPTS, MAX_TOKENS, deadline_s=240)
            timeouts = tier(reader.engine, "redis")["probe_timeouts"]
            loaded = reader.stats()["kv_loaded_tokens"]
        finally:
            server.resume()
    warnings = sum("took longer than the lookup timeout" in r.getMessage() for r in caplog.records)
    with LLM(model=model_path, **ENGINE, **redis) as again:  # its probes have time to answer
        drive(again.engine, PROMPTS, MAX_TOKENS)
        found = again.stats()["kv_external_hit_tokens_redis"]
    wrong = wrong_outputs(run.outputs, cold(model_path, PROMPTS, MAX_TOKENS))
    scorecard.add("redis", "probes past the lookup timeout (SIGSTOP)", requests=len(PROMPTS), faults=1,
                  wrong_outputs=wrong, probe_timeouts=timeouts, warnings_logged=warnings,
                  tokens_loaded_while_paused=loaded, tokens_found_with_time_to_answer=found)
    assert wrong == 0
    assert timeouts == len(PROMPTS) and warnings == 1 and loaded == 0
    assert found == LOADABLE  # what the timed-out probes missed was there


def _instance(model_path: str, redis: RedisServer, *extra: str) -> ServerProcess:
    return ServerProcess(
        "--model", model_path, "--dtype", "float32", "--num-kv-blocks", "64", "--kv-offload", "cpu,redis",
        "--kv-redis-url", redis.url, "--kv-offload-cpu-size", "16MiB", "--kv-chunk-tokens", str(CHUNK),
        "--served-model-name", "tiny", "--log-level", "warning", EAGER_OPS, *extra,
    )


def test_a_shared_redis_outage_leaves_instances_ready(model_path, cold: ColdOracle, redis_factory,
                                                      scorecard: Scorecard):
    """Before: /ready turned 503 on every instance sharing a Redis that went down, though
    each still served: behind a load balancer, a cache outage became a full outage."""
    redis = redis_factory()
    default, strict = _instance(model_path, redis), _instance(model_path, redis, "--ready-requires-tiers", "cpu,redis")
    try:
        redis.kill()

        def unhealthy(process: ServerProcess) -> bool:
            return "redis" in httpx.get(process.url + "/health", timeout=60).json()["unhealthy_tiers"]

        noticed_s = max(wait_until(lambda: unhealthy(default), UNHEALTHY_WITHIN_S, poll_s=0.2),
                        wait_until(lambda: unhealthy(strict), UNHEALTHY_WITHIN_S, poll_s=0.2))
        ready = {name: httpx.get(p.url + "/ready", timeout=60) for name, p in (("default", default), ("strict", strict))}
        texts = []
        for prompt in PROMPTS:
            reply = httpx.post(default.url + "/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
            texts.append(reply.json()["choices"][0]["text"] if reply.status_code == 200 else None)
    finally:
        default.stop()
        strict.stop()
    wrong = sum(t != c for t, c in zip(texts, cold.texts(model_path, PROMPTS, MAX_TOKENS), strict=True))
    scorecard.add("redis", "shared Redis down: /ready by --ready-requires-tiers", requests=len(PROMPTS) + 2,
                  faults=1, wrong_outputs=wrong, ready_status_default=ready["default"].status_code,
                  ready_status_requiring_redis=ready["strict"].status_code, served=sum(t is not None for t in texts),
                  seconds_until_reported=noticed_s)
    assert ready["default"].status_code == 200 and ready["default"].json()["unhealthy_tiers"] == ["redis"]
    assert ready["strict"].status_code == 503
    assert wrong == 0
