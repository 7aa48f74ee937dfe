"""Security: records are authenticated with --kv-secret (records of another secret,
unsigned forgeries, raw Redis SETs and records moved under another key are rejected and
counted); cache_salt isolates tenants in every tier; the admin API refuses missing and
wrong tokens; oversized bodies and absurd max_tokens are refused."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ADMIN_TOKEN
from reliability_support import (
    CHUNK,
    ENGINE,
    REDIS_PREFIX,
    STORE_ONLY,
    ColdOracle,
    FaultServer,
    Run,
    delta,
    drive,
    numeric_stats,
    random_prompts,
    rejected,
    spec_for,
    store_of,
    tier,
    wrong_outputs,
)
from scorecard import Scorecard

from bench.redis_server import RedisServer
from engine import LLM
from kvstore import ChunkKey
from kvstore.record import RecordCodec, parse_header
from kvstore.spec import tensor_bytes

pytestmark = pytest.mark.timeout(180)

PROMPTS = random_prompts(4, 100, seed=41)
MAX_TOKENS = 4
LOADABLE = len(PROMPTS) * (100 - 1) // CHUNK * CHUNK
CHUNKS = LOADABLE // CHUNK
SECRET, OTHER_SECRET = "alpha-secret-0123456789", "beta-secret-9876543210"


def store_options(tiers: str, tmp_path: Path, redis: RedisServer | None) -> dict:
    options: dict = {"kv_offload": tiers, "kv_offload_disk_path": str(tmp_path / "kv")}
    if redis is not None:
        options["kv_redis_url"] = redis.url
    return options


def round_counters(llm: LLM, prompts: list[list[int]], salt: str | None = None) -> tuple[Run, dict]:
    before = numeric_stats(llm.engine)
    run = drive(llm.engine, prompts, MAX_TOKENS, salt=salt)
    return run, delta(before, numeric_stats(llm.engine))


def test_records_of_another_secret_are_rejected_in_disk_and_redis(
    model_path: str, cold: ColdOracle, redis_factory: Callable[[], RedisServer], tmp_path: Path,
    scorecard: Scorecard,
):
    options = {**STORE_ONLY, **store_options("disk,redis", tmp_path, redis_factory())}
    with LLM(model=model_path, **options, kv_secret=SECRET) as llm:
        drive(llm.engine, PROMPTS, MAX_TOKENS)
    with LLM(model=model_path, **options, kv_secret=OTHER_SECRET) as llm:
        run, moved = round_counters(llm, PROMPTS)
        disk, redis = tier(llm.engine, "disk"), tier(llm.engine, "redis")
    wrong = wrong_outputs(run.outputs, cold(model_path, PROMPTS, MAX_TOKENS))
    scorecard.add(
        "security", "records of another --kv-secret", requests=len(PROMPTS), wrong_outputs=wrong,
        loaded_tokens=moved["kv_loaded_tokens"], disk_auth_failures=disk["auth_failures"],
        redis_auth_failures=redis["auth_failures"],
    )
    assert wrong == 0 and moved["kv_loaded_tokens"] == 0
    assert disk["auth_failures"] == redis["auth_failures"] == CHUNKS


def forgeries(codec: RecordCodec, keys: list[str], genuine: list[bytes]) -> list[bytes]:
    """For each key, in turn: random bytes, an unsigned record, a record signed with
    another secret, and a genuine record of another chunk (moved under this key)."""
    other = RecordCodec(codec.spec, secret=OTHER_SECRET.encode())
    payload = tensor_bytes(torch.randn(codec.spec.shape).to(codec.spec.dtype))
    made = []
    for index, key in enumerate(keys):
        kind = index % 4
        if kind == 0:
            made.append(torch.randint(0, 256, (len(genuine[index]),), dtype=torch.uint8).numpy().tobytes())
        elif kind in (1, 2):
            head = parse_header(genuine[index])
            forged_key = ChunkKey(key, head.first_block, head.block_hashes)
            made.append(bytes((codec if kind == 1 else other).encode(forged_key, payload[: head.raw_len])))
        else:
            made.append(genuine[(index + 1) % len(genuine)])
    return made


def forge_redis(server: RedisServer, codec: RecordCodec) -> int:
    client = server.client()
    names = sorted(k.decode() for k in client.keys(f"{REDIS_PREFIX}*"))
    genuine = [client.get(n) for n in names]
    for name, record in zip(names, forgeries(codec, [n.removeprefix(REDIS_PREFIX) for n in names], genuine),
                            strict=True):
        client.set(name, record)  # a raw SET, as anyone with access to Redis can do
    return len(names)


def forge_disk(root: Path, codec: RecordCodec) -> int:
    files = sorted(root.rglob("*.kvc"))
    genuine = [f.read_bytes() for f in files]
    for path, record in zip(files, forgeries(codec, [f.stem for f in files], genuine), strict=True):
        path.write_bytes(record)
    return len(files)


@pytest.mark.parametrize("tiers", ["disk", "redis"])
def test_forged_records_and_raw_sets_are_rejected(
    tiers: str, model_path: str, cold: ColdOracle, redis_factory: Callable[[], RedisServer],
    tmp_path: Path, scorecard: Scorecard,
):
    server = redis_factory() if tiers == "redis" else None
    options = {**STORE_ONLY, **store_options(tiers, tmp_path, server), "kv_secret": SECRET}
    with LLM(model=model_path, **options) as llm:
        drive(llm.engine, PROMPTS, MAX_TOKENS)
        codec = RecordCodec(spec_for(llm.engine))  # an attacker's codec: no secret
    forged = forge_redis(server, codec) if server else forge_disk(tmp_path / "kv", codec)
    with LLM(model=model_path, **options) as llm:
        run, moved = round_counters(llm, PROMPTS)
        runs = [run]
        # the disk scan refuses what it can tell from a record's head; a forgery past it
        # in a prompt is read (and refused) once the prompt's earlier records are back
        while rejected(tier(llm.engine, tiers)) < forged and len(runs) < 3:
            assert store_of(llm.engine).drain(30)
            runs.append(round_counters(llm, PROMPTS)[0])
        stats = tier(llm.engine, tiers)
    want = cold(model_path, PROMPTS, MAX_TOKENS)
    wrong = sum(wrong_outputs(r.outputs, want) for r in runs)
    scorecard.add(
        "security", f"forged records and raw writes ({tiers})", requests=len(PROMPTS) * len(runs), wrong_outputs=wrong,
        forged_records=forged, rejected=rejected(stats), auth_failures=stats["auth_failures"],
        checksum_failures=stats["checksum_failures"], other_rejections=stats["rejected_records"],
        loaded_tokens=moved["kv_loaded_tokens"],
    )
    assert forged == CHUNKS and wrong == 0 and moved["kv_loaded_tokens"] == 0
    assert rejected(stats) == forged and stats["auth_failures"] >= forged // 2


def salt_options(tiers: str, tmp_path: Path, redis_factory: Callable[[], RedisServer]) -> dict:
    if tiers == "device":
        return {**ENGINE, "num_kv_blocks": 256}  # room for every round: nothing is evicted
    server = redis_factory() if tiers == "redis" else None
    return {**STORE_ONLY, **store_options(tiers, tmp_path, server)}


def alone(llm: LLM, prompt: list[int], salt: str) -> tuple[list[int], int, float]:
    """Serve one prompt alone: its tokens, cached tokens and time to first token."""
    run = drive(llm.engine, [prompt], MAX_TOKENS, salt=salt)
    rid = run.ids[0]
    return run.tokens[rid], run.cached[rid], run.first_token_s[rid]


def interleaved(llm: LLM, mine: list[list[int]], fresh: list[list[int]], salt: str
                ) -> tuple[list[tuple[list[int], int, float]], list[float]]:
    """Serve `mine` and `fresh` one prompt at a time, alternating which goes first (so
    that load changes of the machine and order effects hit both alike): the results of
    `mine`, and the times to first token of `fresh`."""
    results, fresh_ttft = [], []
    for index, (a, b) in enumerate(zip(mine, fresh, strict=True)):
        if index % 2:
            fresh_ttft.append(alone(llm, b, salt)[2])
        results.append(alone(llm, a, salt))
        if not index % 2:
            fresh_ttft.append(alone(llm, b, salt)[2])
    return results, fresh_ttft


@pytest.mark.parametrize("tiers", ["device", "cpu", "disk", "redis"])
def test_cache_salt_isolates_tenants(
    tiers: str, model_path: str, cold: ColdOracle, redis_factory: Callable[[], RedisServer],
    tmp_path: Path, scorecard: Scorecard,
):
    fresh = random_prompts(4, 100, seed=42)
    with LLM(model=model_path, **salt_options(tiers, tmp_path, redis_factory)) as llm:
        round_counters(llm, PROMPTS, salt="tenant-a")
        assert tiers == "device" or store_of(llm.engine).drain(30)
        before = numeric_stats(llm.engine)
        other, fresh_ttft = interleaved(llm, PROMPTS, fresh, "tenant-b")
        other_moved = delta(before, numeric_stats(llm.engine))
        unsalted, unsalted_moved = round_counters(llm, PROMPTS)
        again, _ = round_counters(llm, PROMPTS, salt="tenant-a")
    want = cold(model_path, PROMPTS, MAX_TOKENS)
    other_outputs = [tokens for tokens, _, _ in other]
    wrong = sum(wrong_outputs(outputs, want) for outputs in (other_outputs, unsalted.outputs, again.outputs))
    leaked = sum(cached for _, cached, _ in other) + sum(unsalted.cached.values())
    scorecard.add(
        "security", f"cache_salt isolation ({tiers})", requests=5 * len(PROMPTS), wrong_outputs=wrong,
        cached_tokens_other_tenant=leaked, cached_tokens_same_tenant=sum(again.cached.values()),
        median_ttft_s_other_tenant_on_these_prompts=statistics.median(t for _, _, t in other),
        median_ttft_s_other_tenant_on_fresh_prompts=statistics.median(fresh_ttft),
    )
    assert wrong == 0 and leaked == 0
    assert other_moved.get("kv_loaded_tokens", 0) == unsalted_moved.get("kv_loaded_tokens", 0) == 0
    assert other_moved["prefix_cache_hits"] == unsalted_moved["prefix_cache_hits"] == 0
    assert sum(again.cached.values()) == LOADABLE


BAD_AUTH = {
    "no header": {},
    "basic scheme": {"Authorization": f"Basic {ADMIN_TOKEN}"},
    "bearer without a token": {"Authorization": "Bearer"},
    "wrong token": {"Authorization": "Bearer not-the-admin-token-at-all"},
    "token prefix": {"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}"},
    "token plus a character": {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
}
ADMIN_CALLS = [("GET", "/kv/stats", None), ("POST", "/kv/flush", {}),
               ("POST", "/kv/pin", {"prompt": "x"}), ("POST", "/kv/unpin", {"prompt": "x"})]


def test_admin_api_refuses_missing_and_wrong_tokens(fault_server: FaultServer, scorecard: Scorecard):
    good = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=fault_server.url, timeout=30) as http:
        http.post("/v1/completions", json={"model": "tiny", "prompt": random_prompts(1, 70, 43)[0],
                                           "max_tokens": 1})
        entries = http.get("/kv/stats", headers=good).json()["tiers"]["disk"]["entries"]
        statuses = {
            (name, path): http.request(method, path, headers=headers, json=payload).status_code
            for name, headers in BAD_AUTH.items() for method, path, payload in ADMIN_CALLS
        }
        after = http.get("/kv/stats", headers=good).json()["tiers"]["disk"]["entries"]
    refused = sum(status == 401 for status in statuses.values())
    scorecard.add(
        "security", "admin API without a valid token", requests=len(statuses), wrong_outputs=0,
        refused_with_401=refused, attempts=len(statuses), disk_entries_before=entries, disk_entries_after=after,
    )
    assert refused == len(statuses), {k: v for k, v in statuses.items() if v != 401}
    assert entries > 0 and after >= entries  # the refused flushes flushed nothing


def test_oversized_bodies_and_absurd_requests_are_refused(fault_server: FaultServer, scorecard: Scorecard):
    prompt = random_prompts(1, 20, seed=44)[0]
    bodies = {
        "max_tokens 10**9": {"prompt": prompt, "max_tokens": 10**9},
        "max_tokens 2**64": {"prompt": prompt, "max_tokens": 2**64},
        "max_tokens -1": {"prompt": prompt, "max_tokens": -1},
        "prompt of 20000 token ids": {"prompt": [5] * 20000, "max_tokens": 1},
        "17 stop strings": {"prompt": prompt, "max_tokens": 1, "stop": ["x"] * 17},
    }
    raw = {
        "300 KiB body": json.dumps({"model": "tiny", "prompt": "x" * 300_000}).encode(),
        "JSON nested 50000 deep": b"[" * 50_000 + b"]" * 50_000,
    }
    with httpx.Client(base_url=fault_server.url, timeout=60) as http:
        statuses = {name: http.post("/v1/completions", json={"model": "tiny", **b}).status_code
                    for name, b in bodies.items()}
        statuses |= {name: http.post("/v1/completions", content=b, headers={"content-type": "application/json"}
                                     ).status_code for name, b in raw.items()}
        statuses["300 KiB body, chunked"] = http.post(
            "/v1/completions", content=iter([raw["300 KiB body"][i : i + 8192] for i in range(0, 300_000, 8192)])
        ).status_code
        healthy = http.get("/health").status_code
    scorecard.add(
        "security", "oversized bodies and absurd requests", requests=len(statuses), wrong_outputs=0,
        **{f"status ({name})": status for name, status in statuses.items()}, health_after=healthy,
    )
    assert all(400 <= status < 500 for status in statuses.values()), statuses
    assert statuses["300 KiB body"] == statuses["300 KiB body, chunked"] == 413
    assert healthy == 200
