"""How soon a Redis tier is healthy again once Redis answers (issue 16, item 9), after an
outage long enough for the tier's backoff to have grown: the background probe keeps
asking at a short period whatever the backoff, so recovery is one probe, not one
backoff. Measured: seconds from Redis answering to the tier reporting healthy, and to
the first request loaded from Redis again."""

from __future__ import annotations

import time

import pytest
from reliability_support import (
    CHUNK,
    STORE_ONLY,
    ColdOracle,
    delta,
    drive,
    numeric_stats,
    random_prompts,
    store_of,
    tier,
    wait_until,
    wrong_outputs,
)
from scorecard import Scorecard

from engine import LLM

pytestmark = pytest.mark.timeout(180)

PROMPTS = random_prompts(4, 100, seed=71)
MAX_TOKENS = 4
LOADABLE = len(PROMPTS) * (100 - 1) // CHUNK * CHUNK
OUTAGE_S = 6.0  # long enough for a doubling backoff from 0.25 s to pass 4 s


def test_redis_is_healthy_again_soon_after_it_answers(
    model_path: str, cold: ColdOracle, redis_factory, scorecard: Scorecard
):
    server = redis_factory()
    want = cold(model_path, PROMPTS, MAX_TOKENS)
    with LLM(model=model_path, **STORE_ONLY, kv_offload="redis", kv_redis_url=server.url,
             kv_load_timeout=1.0) as llm:
        engine = llm.engine
        runs = [drive(engine, PROMPTS, MAX_TOKENS)]
        assert store_of(engine).drain(30)
        server.kill()
        down = time.monotonic()
        while time.monotonic() - down < OUTAGE_S:  # traffic during the outage: failed I/O
            runs.append(drive(engine, PROMPTS, MAX_TOKENS))
            time.sleep(0.2)
        assert tier(engine, "redis")["health"] == "unhealthy"
        backoff_s = store_of(engine).lower[0].health.backoff_s
        server.start()  # returns once Redis answers a PING; it restarts empty
        answering = time.monotonic()
        healthy_s = wait_until(lambda: tier(engine, "redis")["health"] == "healthy", 20)
        runs.append(drive(engine, PROMPTS, MAX_TOKENS))  # computes and saves again
        assert store_of(engine).drain(30)
        before = numeric_stats(engine)
        runs.append(drive(engine, PROMPTS, MAX_TOKENS))
        reloaded = delta(before, numeric_stats(engine))["kv_external_hit_tokens_redis"]
        first_hit_s = time.monotonic() - answering
    wrong = sum(wrong_outputs(r.outputs, want) for r in runs)
    scorecard.add(
        "redis", "healthy again after Redis answers", requests=sum(len(r.ids) for r in runs),
        wrong_outputs=wrong, recovery_s=healthy_s, outage_s=OUTAGE_S, backoff_when_redis_answered_s=backoff_s,
        seconds_to_loads_from_redis_again=first_hit_s, loaded_tokens_after=reloaded,
    )
    assert wrong == 0
    assert reloaded == LOADABLE
