"""Two engine processes and one external writer hammer the same Redis and disk
directory (a disk budget of a few records, so they evict each other's files). Every
record an engine reads validates, every output equals the cold run's, and every record
left in Redis and on disk validates afterwards."""

from __future__ import annotations

import json
import random
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
from reliability_support import (
    CHUNK,
    RECORD_BYTES,
    REDIS_PREFIX,
    STORE_ONLY,
    ColdOracle,
    engine_codec,
    invalid_disk_records,
    last_json,
    random_prompts,
    record_files,
    record_is_valid,
    rejected,
    spawn,
    wrong_outputs,
)
from scorecard import Scorecard

from bench.redis_server import RedisServer
from engine import LLM
from kvstore.record import RecordCodec

pytestmark = pytest.mark.timeout(300)

PROMPTS = random_prompts(6, 100, seed=51)
MAX_TOKENS = 4
ROUNDS = 3
ENGINES = 2
DISK_RECORDS = 8  # the shared directory's budget, in records: far below the working set


def shuffled_rounds(seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    return [rng.sample(PROMPTS, len(PROMPTS)) for _ in range(ROUNDS)]


def invalid_redis_records(server: RedisServer, codec: RecordCodec) -> tuple[int, int]:
    """(records of `codec`'s model in Redis, how many of them do not validate)."""
    client = server.client()
    names = [k.decode() for k in client.keys(f"{REDIS_PREFIX}{codec.spec.fingerprint.hex()}*")]
    bad = sum(not record_is_valid(codec, n.removeprefix(REDIS_PREFIX), client.get(n)) for n in names)
    return len(names), bad


def engine_codec_for(model: str) -> RecordCodec:
    with LLM(model=model, **STORE_ONLY, kv_offload="cpu", kv_offload_cpu_size="1MiB") as llm:
        return engine_codec(llm.engine)


def test_two_engines_and_a_writer_share_redis_and_disk(
    model_path: str, cold: ColdOracle, redis_factory: Callable[[], RedisServer], tmp_path: Path,
    scorecard: Scorecard,
):
    server, disk = redis_factory(), tmp_path / "kv"
    codec = engine_codec_for(model_path)
    budget = DISK_RECORDS * RECORD_BYTES
    writer = spawn("store_writer.py", {
        "fingerprint": codec.spec.fingerprint.hex(), "shape": list(codec.spec.shape), "dtype": "float32",
        "chunk_tokens": CHUNK, "disk_path": str(disk), "disk_size": budget, "redis_url": server.url,
    })
    options = {**STORE_ONLY, "kv_offload": "disk,redis", "kv_offload_disk_path": str(disk),
               "kv_offload_disk_size": f"{budget}B", "kv_redis_url": server.url}
    rounds = [shuffled_rounds(seed) for seed in range(ENGINES)]
    engines = [spawn("engine_worker.py", {"mode": "run", "model": model_path, "options": options,
                                          "rounds": r, "max_tokens": MAX_TOKENS}) for r in rounds]
    try:
        results = [last_json(e) for e in engines]
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    written = max((json.loads(line)["written"] for line in writer.stdout.read().splitlines()), default=0)
    wrong = sum(
        wrong_outputs(done["outputs"], cold(model_path, prompts, MAX_TOKENS))
        for result, plan in zip(results, rounds, strict=True)
        for done, prompts in zip(result["rounds"], plan, strict=True)
    )
    refused = sum(rejected(r["tiers"][t]) for r in results for t in ("disk", "redis"))
    loaded = [sum(d["counters"]["kv_loaded_tokens"] for d in r["rounds"]) for r in results]
    in_redis, bad_redis = invalid_redis_records(server, codec)
    bad_disk = invalid_disk_records(codec, disk)
    scorecard.add(
        "concurrency", "2 engines + 1 writer on one Redis and one directory",
        requests=ENGINES * ROUNDS * len(PROMPTS), wrong_outputs=wrong, faults=written,
        torn_records=len(bad_disk) + bad_redis,
        records_refused_by_engines=refused, loaded_tokens_per_engine=str(loaded), writer_records=written,
        engine_records_in_redis=in_redis, record_files_on_disk=len(record_files(disk)),
        disk_evictions=sum(r["tiers"]["disk"]["evictions"] for r in results),
        disk_budget_bytes=budget, disk_usage_bytes_per_engine=str([r["tiers"]["disk"]["usage_bytes"] for r in results]),
    )
    assert wrong == 0 and refused == 0
    assert bad_disk == [] and bad_redis == 0
    assert all(n > 0 for n in loaded) and written > 0
