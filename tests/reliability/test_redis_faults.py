"""Redis faults under a running engine (redis tier only, no device prefix cache, so every
reuse goes through Redis): killed mid-run and restarted, paused with SIGSTOP, restarted
empty. Requests keep completing with the cold run's tokens, the tier's health goes
unhealthy and comes back by itself, and no step waits longer than the timeouts allow."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence

import pytest
from reliability_support import (
    CHUNK,
    REDIS_PREFIX,
    STORE_ONLY,
    ColdOracle,
    Run,
    delta,
    drive,
    held_blocks,
    numeric_stats,
    random_prompts,
    store_of,
    tier,
    wait_until,
    wrong_outputs,
)
from scorecard import Scorecard

from bench.redis_server import RedisServer
from engine import LLM
from kvstore import ChunkKey, LookupResult, TieredStore

pytestmark = pytest.mark.timeout(180)

PROMPTS = random_prompts(6, 100, seed=11)
MAX_TOKENS = 4
LOADABLE = len(PROMPTS) * (100 - 1) // CHUNK * CHUNK
CHUNKS = LOADABLE // CHUNK
LOAD_TIMEOUT_S = 1.0
LOOKUP_TIMEOUT_S = 0.1  # StoreConfig.lookup_timeout_s: the Redis round trip inside a step
LOOKUP_SLACK_S = 0.25  # thread wake-ups on a busy 2-core machine
RECOVERY_TIMEOUT_S = 20.0


class TimedLookups:
    """Times every call of the store's real `lookup` (the only store call a step waits on)."""

    def __init__(self, store: TieredStore) -> None:
        self._lookup = store.manager.lookup
        self.max_s = 0.0
        store.manager.lookup = self

    def __call__(self, keys: Sequence[ChunkKey]) -> LookupResult:
        started = time.perf_counter()
        try:
            return self._lookup(keys)
        finally:
            self.max_s = max(self.max_s, time.perf_counter() - started)


class Phases:
    """Runs the workload on one engine, phase after phase, keeping every run and the
    slowest store lookup of each."""

    def __init__(self, llm: LLM, cold: list[list[int]]) -> None:
        self.engine = llm.engine
        self.cold = cold
        self.runs: dict[str, Run] = {}
        self.lookup_s: dict[str, float] = {}
        self._lookups = TimedLookups(store_of(llm.engine))

    def run(self, name: str, on_step: Callable[[int], None] | None = None) -> dict[str, float]:
        """One round of the workload; returns the engine counters it moved."""
        before = numeric_stats(self.engine)
        self._lookups.max_s = 0.0
        self.runs[name] = drive(self.engine, PROMPTS, MAX_TOKENS, on_step=on_step)
        self.lookup_s[name] = self._lookups.max_s
        return delta(before, numeric_stats(self.engine))

    def max_lookup_s(self, *names: str) -> float:
        return max(self.lookup_s[n] for n in names)

    def health(self) -> str:
        return tier(self.engine, "redis")["health"]

    def outages(self) -> int:
        """Outages the redis tier came back from, as its health monitor counted them."""
        (redis,) = (t for t in store_of(self.engine).lower if t.name == "redis")
        return redis.health.recoveries

    def requests(self) -> int:
        return sum(len(r.ids) for r in self.runs.values())

    def wrong(self) -> int:
        return sum(wrong_outputs(r.outputs, self.cold) for r in self.runs.values())

    def max_step_s(self, *names: str) -> float:
        return max(self.runs[n].max_step_s for n in names)

    def drained_record_count(self, server: RedisServer) -> int:
        """Records in Redis once every write is done (the block index lives apart)."""
        assert store_of(self.engine).drain(30)
        return sum(1 for _ in server.client().scan_iter(f"{REDIS_PREFIX}*"))


@contextlib.contextmanager
def warm_phases(model: str, server: RedisServer, cold: ColdOracle) -> Iterator[Phases]:
    """An engine on `server` (redis tier only) that ran the phases "warm" (every chunk
    stored) and "hits" (every chunk loaded); closed on exit."""
    with LLM(model=model, **STORE_ONLY, kv_offload="redis", kv_redis_url=server.url,
             kv_load_timeout=LOAD_TIMEOUT_S) as llm:
        phases = Phases(llm, cold(model, PROMPTS, MAX_TOKENS))
        phases.run("warm")
        assert phases.drained_record_count(server) == CHUNKS
        assert phases.run("hits")["kv_external_hit_tokens_redis"] == LOADABLE
        yield phases


def healthy_after(phases: Phases, since: float) -> float:
    """Seconds from `since` (the fault's end) until the tier reports healthy."""
    wait_until(lambda: phases.health() == "healthy", RECOVERY_TIMEOUT_S)
    return time.monotonic() - since


def step_bound(phases: Phases) -> float:
    """What a step may take during a fault: the slowest healthy step plus one Redis
    lookup timeout per request looked up in it."""
    return phases.max_step_s("warm", "hits") + (LOOKUP_TIMEOUT_S + LOOKUP_SLACK_S) * len(PROMPTS)


def assert_fault_contained(phases: Phases, fault: tuple[str, str], bound: float, after: dict[str, float]) -> None:
    """Every output right; during the `fault` phases no step over `bound` and no lookup over
    its timeout; once the fault is over (the `after` phase) every chunk loads again."""
    assert phases.wrong() == 0
    assert phases.max_step_s(*fault) <= bound
    assert phases.max_lookup_s(*fault) <= LOOKUP_TIMEOUT_S + LOOKUP_SLACK_S
    assert after["kv_external_hit_tokens_redis"] == LOADABLE


def test_redis_killed_mid_run_and_restarted(model_path, cold: ColdOracle, redis_factory, scorecard: Scorecard):
    server = redis_factory()
    with warm_phases(model_path, server, cold) as phases:
        phases.run("killed", on_step=lambda n: n == 1 and server.kill())
        detected = wait_until(lambda: phases.health() == "unhealthy", RECOVERY_TIMEOUT_S)
        assert phases.run("down")["kv_loaded_tokens"] == 0
        restarted = time.monotonic()
        server.start()  # same port, empty: Redis keeps nothing across restarts here
        recovery = healthy_after(phases, restarted)
        phases.run("refill")
        assert phases.drained_record_count(server) == CHUNKS
        after = phases.run("after")
        bound = step_bound(phases)
        scorecard.add(
            "redis", "killed mid-run, restarted", requests=phases.requests(),
            wrong_outputs=phases.wrong(), faults=1, leaked_blocks=held_blocks(phases.engine), recovery_s=recovery, seconds_to_notice_the_kill=detected,
            max_step_s_down=phases.max_step_s("killed", "down"), step_bound_s=bound,
            max_lookup_s_down=phases.max_lookup_s("killed", "down"), redis_errors=tier(phases.engine, "redis")["errors"],
            loaded_tokens_after=after["kv_external_hit_tokens_redis"],
        )
    assert_fault_contained(phases, ("killed", "down"), bound, after)


def test_redis_paused_forces_timeouts(model_path, cold: ColdOracle, redis_factory, scorecard: Scorecard):
    server = redis_factory()
    with warm_phases(model_path, server, cold) as phases:
        try:
            paused = phases.run("paused", on_step=lambda n: n == 1 and server.pause())
            still = phases.run("still paused")
            assert phases.health() == "unhealthy"
        finally:
            server.resume()
        resumed = time.monotonic()
        recovery = healthy_after(phases, resumed)
        after = phases.run("after")
        bound = step_bound(phases)
        scorecard.add(
            "redis", "paused (SIGSTOP)", requests=phases.requests(), wrong_outputs=phases.wrong(),
            faults=1, leaked_blocks=held_blocks(phases.engine), recovery_s=recovery, max_step_s_paused=phases.max_step_s("paused", "still paused"),
            step_bound_s=bound, max_lookup_s_paused=phases.max_lookup_s("paused", "still paused"),
            redis_errors=tier(phases.engine, "redis")["errors"],
            loaded_tokens_while_paused=paused["kv_loaded_tokens"] + still["kv_loaded_tokens"],
            loaded_tokens_after=after["kv_external_hit_tokens_redis"],
            seconds_to_first_hit_after_resume=time.monotonic() - resumed,
        )
    assert_fault_contained(phases, ("paused", "still paused"), bound, after)


def test_redis_restarted_empty_mid_run(model_path, cold: ColdOracle, redis_factory, scorecard: Scorecard):
    server = redis_factory()
    recovery: list[float] = []

    def restart_empty(step: int) -> None:
        """Mid-run: kill and restart Redis, then wait (steps paused) until the tier counts
        the outage: it may never have looked unhealthy, but a probe finds another Redis."""
        if step == 1:
            outages = phases.outages()
            server.kill()
            restarted = time.monotonic()
            server.start()
            wait_until(lambda: phases.outages() > outages and phases.health() == "healthy", RECOVERY_TIMEOUT_S)
            recovery.append(time.monotonic() - restarted)

    with warm_phases(model_path, server, cold) as phases:
        emptied = phases.run("restarted", on_step=restart_empty)
        phases.run("refill")
        refilled = phases.drained_record_count(server)
        server.client().flushall()
        flushed = phases.run("flushed")
        assert phases.drained_record_count(server) == CHUNKS
        after = phases.run("after")
        scorecard.add(
            "redis", "restarted empty / flushed", requests=phases.requests(),
            wrong_outputs=phases.wrong(), faults=2, leaked_blocks=held_blocks(phases.engine),
            recovery_s=recovery[0],
            load_failures=emptied["kv_load_failures"] + flushed["kv_load_failures"],
            loaded_tokens_after_flush=flushed["kv_loaded_tokens"],
            loaded_tokens_after=after["kv_external_hit_tokens_redis"],
        )
    assert phases.wrong() == 0
    assert refilled == CHUNKS
    assert flushed["kv_loaded_tokens"] == 0
    assert after["kv_external_hit_tokens_redis"] == LOADABLE
