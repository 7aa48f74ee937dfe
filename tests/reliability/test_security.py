"""Security: records are authenticated with --kv-secret (records of another secret,
unsigned forgeries, raw Redis SETs and records moved under another key are rejected and
counted); cache_salt isolates tenants in every tier; the admin API refuses missing and
wrong tokens; oversized bodies and absurd max_tokens are refused."""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from reliability_support import (
    ADMIN_TOKEN,
    BODY_READ_TIMEOUT_S,
    BODY_READS_PER_CLIENT,
    CHUNK,
    ENGINE,
    REDIS_PREFIX,
    STORE_ONLY,
    ColdOracle,
    FaultServer,
    Run,
    delta,
    drive,
    held_blocks,
    numeric_stats,
    random_prompts,
    rejected,
    spec_for,
    store_of,
    tier,
    wait_until,
    wrong_outputs,
)
from scorecard import Scorecard

from bench.redis_server import RedisServer
from engine import LLM
from engine.config import EngineConfig
from engine.kv_security import shared_tiers_without_secret
from engine.server.metrics import ServerMetrics
from kvstore import ChunkKey
from kvstore.record import RecordCodec, parse_header
from kvstore.spec import tensor_bytes
from tests.server.server_helpers import RawConnection

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
    # The other instance rewrote every record with its secret; the right one, read from a
    # file, loads them again once this instance wrote them back.
    secret_file = tmp_path / "secret"
    secret_file.write_text(OTHER_SECRET + "\n")
    with LLM(model=model_path, **options, kv_secret_file=str(secret_file)) as llm:
        again, from_file = round_counters(llm, PROMPTS)
    want = cold(model_path, PROMPTS, MAX_TOKENS)
    wrong = wrong_outputs(run.outputs, want) + wrong_outputs(again.outputs, want)
    scorecard.add(
        "security", "records of another --kv-secret", requests=2 * len(PROMPTS), wrong_outputs=wrong,
        faults=2 * CHUNKS, loaded_tokens=moved["kv_loaded_tokens"], disk_auth_failures=disk["auth_failures"],
        redis_auth_failures=redis["auth_failures"], loaded_tokens_with_the_secret_from_a_file=from_file["kv_loaded_tokens"],
    )
    assert wrong == 0 and moved["kv_loaded_tokens"] == 0
    assert disk["auth_failures"] == redis["auth_failures"] == CHUNKS
    assert from_file["kv_loaded_tokens"] == LOADABLE


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


def rejections_in_metrics(llm: LLM, tier_name: str) -> dict[str, float]:
    """`kvtier:store_rejected_records` of one tier by reason, as /metrics renders it from
    the engine's stats."""
    metrics = ServerMetrics("tiny", llm.engine.config.kv_offload)
    metrics.watch(llm.engine.stats)
    text = metrics.render()[0].decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "kvtier:store_rejected_records")
    return {s.labels["reason"]: s.value for s in family.samples
            if s.name.endswith("_total") and s.labels["tier"] == tier_name}


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
        exported = rejections_in_metrics(llm, tiers)
    want = cold(model_path, PROMPTS, MAX_TOKENS)
    wrong = sum(wrong_outputs(r.outputs, want) for r in runs)
    scorecard.add(
        "security", f"forged records and raw writes ({tiers})", requests=len(PROMPTS) * len(runs), wrong_outputs=wrong,
        faults=forged,
        forged_records=forged, rejected=rejected(stats), auth_failures=stats["auth_failures"],
        checksum_failures=stats["checksum_failures"], other_rejections=stats["rejected_records"],
        loaded_tokens=moved["kv_loaded_tokens"],
        **{f"metrics rejected_records{{reason={r}}}": n for r, n in exported.items()},
    )
    assert forged == CHUNKS and wrong == 0 and moved["kv_loaded_tokens"] == 0
    assert rejected(stats) == forged and stats["auth_failures"] >= forged // 2
    assert exported == {"checksum": stats["checksum_failures"], "hmac": stats["auth_failures"],
                        "identity": stats["rejected_records"]}
    assert exported["identity"] > 0  # the moved records


def test_a_forged_record_of_nan_kv_fails_only_its_request(
    model_path: str, cold: ColdOracle, tmp_path: Path, scorecard: Scorecard
):
    """Without a secret, a record of NaN KV with a valid checksum under a genuine key is
    loaded (the issue's reproduction of a NaN logprob): its request gets NaN logits and
    fails alone with a clear error; the requests batched with it, and those that reuse
    its blocks afterwards, get the cold outputs."""
    victim = random_prompts(1, 100, seed=45)[0]
    others = [random_prompts(1, n, seed=n)[0] for n in (50, 60, 70, 80, 90)]
    options = {**STORE_ONLY, **store_options("disk", tmp_path, None), "num_kv_blocks": 40}
    with LLM(model=model_path, **options) as llm:
        drive(llm.engine, [victim], MAX_TOKENS)
        codec = RecordCodec(spec_for(llm.engine))
    nan_kv = tensor_bytes(torch.full(codec.spec.shape, float("nan")).to(codec.spec.dtype))
    files = sorted((tmp_path / "kv").rglob("*.kvc"))
    for path in files:  # the genuine record's key and blocks, NaN payload, valid checksum
        head = parse_header(path.read_bytes())
        key = ChunkKey(path.stem, head.first_block, head.block_hashes)
        path.write_bytes(bytes(codec.encode(key, nan_kv[: head.raw_len])))
    with LLM(model=model_path, **options) as llm:
        run = drive(llm.engine, [victim, *others], MAX_TOKENS)
        after = drive(llm.engine, others, MAX_TOKENS)
        leaked = held_blocks(llm.engine)
    want = cold(model_path, others, MAX_TOKENS)
    wrong = wrong_outputs(run.outputs[1:], want) + wrong_outputs(after.outputs, want)
    victim_id = run.ids[0]
    scorecard.add(
        "security", "forged record of NaN KV (no secret)", requests=len(run.ids) + len(after.ids),
        wrong_outputs=wrong, faults=len(files), leaked_blocks=leaked, victim_finish=str(run.finish[victim_id]),
        batch_mates_finished=sum(run.finish[i] == "length" for i in run.ids[1:]),
    )
    assert run.finish[victim_id] == "error" and "NaN or infinite logits" in run.errors[victim_id]
    assert wrong == 0 and leaked == 0
    assert all(run.finish[i] == "length" for i in run.ids[1:])
    assert all(after.finish[i] == "length" for i in after.ids)


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

        def disk_entries() -> int:
            return http.get("/kv/stats", headers=good).json()["tiers"]["disk"]["entries"]

        wait_until(lambda: disk_entries() > 0, 30)  # written behind the request
        entries = disk_entries()
        statuses = {
            (name, path): http.request(method, path, headers=headers, json=payload).status_code
            for name, headers in BAD_AUTH.items() for method, path, payload in ADMIN_CALLS
        }
        after = disk_entries()
    refused = sum(status == 401 for status in statuses.values())
    scorecard.add(
        "security", "admin API without a valid token", requests=len(statuses), wrong_outputs=0,
        faults=len(statuses),
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
        faults=len(statuses),
        **{f"status ({name})": status for name, status in statuses.items()}, health_after=healthy,
    )
    assert all(400 <= status < 500 for status in statuses.values()), statuses
    assert statuses["300 KiB body"] == statuses["300 KiB body, chunked"] == 413
    assert healthy == 200


SLOW_SOCKETS = 40


def _answer(connection: RawConnection, started: float) -> tuple[int, float, bool]:
    """The status a stalled upload got, when (seconds after `started`), and whether the
    server then closed the connection."""
    try:
        status, _ = connection.response()
    except ConnectionError:
        status = 0
    return status, time.monotonic() - started, connection.closed_by_server(5.0)


def test_slow_request_bodies_are_cut_off_and_capped_per_client(fault_server: FaultServer,
                                                               scorecard: Scorecard):
    """40 sockets announce 1,000 bytes and send 10 (before: all held for more than 70 s)."""
    connections = [RawConnection(fault_server.url) for _ in range(SLOW_SOCKETS)]
    started = time.monotonic()
    for connection in connections:
        connection.request("/v1/completions", b'{"prompt":', content_length=1000)
    other_client = httpx.Client(base_url=fault_server.url, timeout=30,
                                transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    with ThreadPoolExecutor(SLOW_SOCKETS) as pool, other_client:
        answers = list(pool.map(lambda c: _answer(c, started), connections))
        meanwhile = other_client.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7],
                                                               "max_tokens": 1}).status_code
    for connection in connections:
        connection.close()
    with httpx.Client(base_url=fault_server.url, timeout=30) as http:
        after = http.post("/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 1})
    statuses = [status for status, _, _ in answers]
    timed_out = [s for s, _, _ in answers if s == 408]
    held_s = max(seconds for _, seconds, _ in answers)
    scorecard.add(
        "security", "slow request bodies (40 sockets, 10 of 1,000 bytes)", requests=SLOW_SOCKETS + 2,
        wrong_outputs=0, faults=SLOW_SOCKETS, recovery_s=held_s, refused_at_once_503=statuses.count(503),
        timed_out_408=len(timed_out), connections_closed=sum(closed for _, _, closed in answers),
        body_read_timeout_s=BODY_READ_TIMEOUT_S, longest_hold_s=held_s,
        status_of_another_client_meanwhile=meanwhile, status_after=after.status_code,
    )
    assert statuses.count(503) == SLOW_SOCKETS - BODY_READS_PER_CLIENT
    assert len(timed_out) == BODY_READS_PER_CLIENT
    assert all(closed for _, _, closed in answers)
    assert held_s < BODY_READ_TIMEOUT_S + 2
    assert meanwhile == 200 and after.status_code == 200


SURROGATE_INPUTS = {  # JSON that spells lone UTF-16 surrogates (valid JSON, invalid Unicode)
    "completion prompt": ("/v1/completions", {"prompt": "\ud800", "max_tokens": 2}),
    "one prompt of a list": ("/v1/completions", {"prompt": ["fine", "x\udfff"], "max_tokens": 2}),
    "stop string": ("/v1/completions", {"prompt": "fine", "stop": "\udc00", "max_tokens": 2}),
    "cache_salt": ("/v1/completions", {"prompt": "fine", "cache_salt": "\ud83d", "max_tokens": 2}),
    "chat content": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}),
    "chat content part": ("/v1/chat/completions",
                          {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]}),
    "pin prompt": ("/kv/pin", {"prompt": "\ud800"}),
}


def test_lone_surrogates_are_refused_on_a_live_connection(fault_server: FaultServer, scorecard: Scorecard):
    connection = RawConnection(fault_server.url)
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    try:
        answers = {name: connection.post(path, json.dumps({"model": "tiny", **body}).encode(), auth)
                   for name, (path, body) in SURROGATE_INPUTS.items()}
        status, good = connection.post("/v1/completions", json.dumps(
            {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "ignore_eos": True}).encode())
    finally:
        connection.close()
    codes = {name: json.loads(body)["error"]["code"] for name, (_, body) in answers.items()}
    scorecard.add(
        "security", "lone UTF-16 surrogates in prompts, chat, stop, salt, pin", requests=len(answers) + 1,
        wrong_outputs=0, faults=len(answers), **{f"status ({name})": s for name, (s, _) in answers.items()},
        status_of_the_next_request_on_the_same_connection=status,
    )
    assert all(s == 400 for s, _ in answers.values())
    # pydantic's own JSON parser (the admin API's) refuses the escape itself
    assert codes == {**dict.fromkeys(codes, "invalid_value"), "pin prompt": "invalid_json"}
    assert status == 200 and json.loads(good)["usage"]["completion_tokens"] == 2


def engine_request_count(url: str) -> float:
    """Requests the server's engine has finished or aborted so far."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    family = next(f for f in families if f.name == "vllm:request_success")
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def test_too_many_prompts_are_refused_before_any_work(fault_server: FaultServer, scorecard: Scorecard):
    """Before: 400 prompts on an idle server got 503 queue_full, which could never succeed;
    50,000 spent 5.9 s tokenizing and ran 320 requests before the 503."""
    cases = {"65 prompts": ["x"] * 65, "400 prompts": ["x"] * 400, "50,000 token-id prompts": [[5]] * 50_000}
    seen = engine_request_count(fault_server.url)
    answers, seconds = {}, {}
    with httpx.Client(base_url=fault_server.url, timeout=60) as http:
        for name, prompt in cases.items():
            started = time.monotonic()
            answers[name] = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
            seconds[name] = time.monotonic() - started
        fits = http.post("/v1/completions", json={"model": "tiny", "prompt": [[5, 6]] * 64, "max_tokens": 1})
    ran = engine_request_count(fault_server.url) - seen
    scorecard.add(
        "security", "too many prompts in one completion", requests=len(cases) + 1, wrong_outputs=0,
        faults=len(cases), **{f"status ({name})": a.status_code for name, a in answers.items()},
        **{f"seconds ({name})": s for name, s in seconds.items()}, status_of_64_prompts=fits.status_code,
        engine_requests_run=ran,
    )
    assert all(a.status_code == 400 and a.json()["error"]["code"] == "too_many_prompts" for a in answers.values())
    assert fits.status_code == 200 and ran == 64  # only the 64 prompts that fit ever reached the engine


def test_pins_with_token_ids_outside_the_vocabulary_are_refused(fault_server: FaultServer, scorecard: Scorecard):
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    cases = {f"{path} {name}": (path, ids) for path in ("/kv/pin", "/kv/unpin")
             for name, ids in (("2**32", [5, 2**32]), ("2**64", [5, 2**64]), ("10**6", [5, 10**6]), ("-1", [-1]))}
    with httpx.Client(base_url=fault_server.url, timeout=30) as http:
        statuses = {name: http.post(path, headers=auth, json={"prompt": ids}).status_code
                    for name, (path, ids) in cases.items()}
        pinned = http.post("/kv/pin", headers=auth, json={"prompt": [5] * 70}).status_code
        healthy = http.get("/health").status_code
    scorecard.add(
        "security", "pin and unpin with token ids outside the vocabulary", requests=len(cases) + 1,
        wrong_outputs=0, faults=len(cases), **{f"status ({name})": s for name, s in statuses.items()},
        status_of_a_valid_pin=pinned, health_after=healthy,
    )
    assert set(statuses.values()) == {400} and pinned == 200 and healthy == 200


def test_shared_tiers_without_a_secret_warn_at_start(fault_server: FaultServer, model_path: str,
                                                     caplog: pytest.LogCaptureFixture, scorecard: Scorecard):
    """The fault server (another process, no --kv-secret) uses its disk directory: an
    engine joining it without a secret warns; with one, it does not. A Redis tier off
    loopback is reported from the options alone (nothing listens there)."""
    shared = {**STORE_ONLY, "kv_offload": "disk", "kv_offload_disk_path": str(fault_server.disk_path)}
    warnings = {}
    for name, extra in (("without a secret", {}), ("with --kv-secret", {"kv_secret": SECRET})):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engine.kv_security"):
            LLM(model=model_path, **shared, **extra).close()
        warnings[name] = [r.getMessage() for r in caplog.records]
    remote = shared_tiers_without_secret(EngineConfig(kv_offload="redis", kv_redis_url="redis://10.9.8.7:6379"))
    scorecard.add(
        "security", "shared tiers without --kv-secret", requests=3, wrong_outputs=0, faults=2,
        **{f"warnings ({name})": len(w) for name, w in warnings.items()}, remote_redis_reported=len(remote),
    )
    assert len(warnings["without a secret"]) == 1 and "another running process" in warnings["without a secret"][0]
    assert warnings["with --kv-secret"] == [] and len(remote) == 1
