"""The engine with --kv-offload: greedy outputs never change (transformers and the
no-offload engine agree), and the store really serves what the device cache evicted.
Real tiers: cpu memory, files under tmp_path, a real redis-server."""

from __future__ import annotations

from pathlib import Path

import pytest
from offload_workloads import (
    CHUNK,
    counters,
    delta,
    generate,
    greedy,
    hf_greedy,
    one_by_one,
    random_prompts,
)

from connectors import KVStoreNotConfiguredError
from engine import LLM
from engine.config import ConfigError

LENGTHS = [150, 97, 260, 33, 81, 120]
MAX_TOKENS = [8, 12, 6, 9, 5, 10]
CHUNK_BYTES = CHUNK * 2 * 2 * 2 * 16 * 4  # tokens x (K, V) x layers x kv heads x head dim x fp32
# 24 blocks of 16 tokens cannot hold four of these requests at once (they need ~40):
# prompts are evicted between rounds and running requests are preempted.
SMALL_POOL = {"dtype": "float32", "num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 4,
              "kv_chunk_tokens": CHUNK}


def offload_options(tiers: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict:
    options: dict = {"kv_offload": tiers, "kv_offload_disk_path": str(tmp_path / "disk")}
    if "redis" in tiers:
        options["kv_redis_url"] = request.getfixturevalue("redis_url")
    if "cpu" in tiers and tiers != "cpu":
        options["kv_offload_cpu_size"] = f"{12 * CHUNK_BYTES}B"  # too small: lower tiers serve too
    return options


@pytest.fixture(scope="module")
def workload(tiny_llama):
    prompts = random_prompts(LENGTHS, vocab_size=480)
    shared = prompts[2][:100]
    prompts[4] = shared + prompts[4][:40]  # a prefix shared with prompt 2, ending mid-chunk
    return prompts, hf_greedy(tiny_llama, prompts, MAX_TOKENS)


def test_the_no_offload_engine_matches_transformers_on_the_workload(tiny_llama, workload):
    prompts, expected = workload
    llm = LLM(model=tiny_llama, **SMALL_POOL)
    assert generate(llm, prompts, MAX_TOKENS) == expected
    assert generate(llm, prompts, MAX_TOKENS) == expected
    assert llm.stats()["num_preemptions_total"] > 0
    assert "kv_tiers" not in llm.stats()


@pytest.mark.parametrize("tiers", ["cpu", "disk", "redis", "cpu,disk", "cpu,disk,redis"])
def test_outputs_equal_transformers_for_every_tier_combination(tiny_llama, workload, tiers, tmp_path, request):
    prompts, expected = workload
    with LLM(model=tiny_llama, **SMALL_POOL, **offload_options(tiers, tmp_path, request)) as llm:
        first = generate(llm, prompts, MAX_TOKENS)
        before = counters(llm)
        second = generate(llm, prompts, MAX_TOKENS)
        second_round = delta(before, counters(llm))
        stats = llm.stats()
    assert first == expected and second == expected
    assert stats["num_preemptions_total"] > 0
    assert stats["kv_saved_chunks"] > 0 and stats["kv_load_failures"] == 0
    assert second_round["kv_loaded_tokens"] > 0.5 * sum(LENGTHS)
    lowest = tiers.split(",")[min(1, tiers.count(","))]  # the tier below cpu, if any
    assert stats[f"kv_external_hit_tokens_{lowest}"] > 0
    for tier in tiers.split(","):
        assert stats["kv_tiers"][tier]["bytes_written"] > 0


def test_long_context_replay_loads_the_second_round_from_the_cpu_tier(tiny_llama):
    # 10 documents of 16 blocks + 1 token, 2.3x the device pool: served in order, twice.
    docs = random_prompts([257] * 10, vocab_size=480, seed=7)
    pool = {"dtype": "float32", "num_kv_blocks": 74, "kv_chunk_tokens": CHUNK}
    rounds = {}
    for tiers in ("", "cpu"):
        with LLM(model=tiny_llama, kv_offload=tiers, **pool) as llm:
            first = one_by_one(llm, docs, 4)
            before = counters(llm)
            second = one_by_one(llm, docs, 4)
            rounds[tiers] = (first, second, delta(before, counters(llm)))
    plain_first, plain_second, plain = rounds[""]
    first, second, cpu = rounds["cpu"]
    assert plain["prefix_cache_hits"] == 0, "LRU thrashing: no device prefix hit in round 2"
    assert cpu["kv_loaded_tokens"] >= 0.95 * 257 * 10
    assert cpu["kv_external_hit_tokens_cpu"] == cpu["kv_loaded_tokens"]
    assert first == second == plain_first == plain_second


@pytest.mark.parametrize("tiers", ["cpu", "disk"])
def test_a_replayed_prompt_ending_inside_a_chunk_loads_up_to_its_last_full_block(tiny_llama, tmp_path, tiers):
    # Each prompt ends one block or more past its last full chunk: the tail chunk carries
    # those blocks, so only the last partial block (or the last token) is recomputed.
    lengths = [150, 97, 120, 81]
    prompts = random_prompts(lengths, vocab_size=480, seed=13)
    with LLM(model=tiny_llama, dtype="float32", kv_offload=tiers, kv_chunk_tokens=CHUNK,
             kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        first = one_by_one(llm, prompts, 5)
        assert llm.engine.connector.store.drain(30)  # the disk writes are known (a record still
        # being written is a miss, which recomputes)
        llm.engine.kv_cache_manager.reset_prefix_cache()
        before = counters(llm)
        again = one_by_one(llm, prompts, 5)
        loaded = delta(before, counters(llm))["kv_loaded_tokens"]
    assert again == first == generate(LLM(model=tiny_llama, dtype="float32"), prompts, [5] * 4)
    assert loaded == sum((n - 1) // 16 * 16 for n in lengths)


@pytest.mark.parametrize("tiers", ["cpu", "disk", "redis"])
def test_new_questions_on_a_stored_document_load_every_shared_block(tiny_llama, tmp_path, tiers, request):
    # Records of 4 blocks; the document has 10 full blocks and 5 tokens: records [0-3],
    # [4-7] and the tail [8-9]. Each question shares a different run of the document:
    # all of it (the tail record read whole), 120 tokens (7 blocks: [4-7] read in part),
    # 40 tokens (2 blocks: the first record in part). Then a second instance on the same
    # directory or Redis asks other questions (everything from the store).
    doc = random_prompts([165], vocab_size=480, seed=31)[0]
    shared = [165, 120, 40]

    def questions(seed: int) -> list[list[int]]:
        asked = random_prompts([9, 14, 20], vocab_size=480, seed=seed)
        return [doc[:n] + q for n, q in zip(shared, asked, strict=True)]

    rounds = [questions(32)] + ([questions(33)] if tiers != "cpu" else [])
    options = {"dtype": "float32", "kv_offload": tiers, "kv_chunk_tokens": 64,
               "kv_offload_disk_path": str(tmp_path / "kv")}
    if tiers == "redis":
        options["kv_redis_url"] = request.getfixturevalue("redis_url")

    def ask(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], float]]:
        answers = []
        for prompt in prompts:
            llm.engine.kv_cache_manager.reset_prefix_cache()  # the device keeps nothing
            before = counters(llm)
            answer = one_by_one(llm, [prompt], 6)[0]
            answers.append((answer, delta(before, counters(llm))["kv_loaded_tokens"]))
        return answers

    for number, prompts in enumerate(rounds):
        expected = hf_greedy(tiny_llama, prompts, [6] * len(prompts))
        with LLM(model=tiny_llama, **options) as llm:
            if number == 0:
                one_by_one(llm, [doc], 1)
                assert llm.engine.connector.store.drain(30)  # the disk and Redis writes are known
            assert ask(llm, prompts) == [(tokens, n // 16 * 16) for tokens, n in zip(expected, shared, strict=True)]
            # Without a cpu tier to promote into, disk records (in the page cache) are read
            # straight into the device blocks, a record read in part included; Redis replies
            # land in the slots.
            placed = llm.engine.connector.store.counters["placed_records"]
            assert placed > 0 if tiers == "disk" else placed == 0


def test_offload_preemption_recomputes_fewer_tokens_than_recompute(tiny_llama):
    # Six requests with long outputs in a pool of a third of what they need: preempted
    # requests have computed several output chunks that recompute mode recomputes.
    prompts = random_prompts([70] * 6, vocab_size=480, seed=3)
    pool = {"dtype": "float32", "num_kv_blocks": 26, "max_num_seqs": 6, "kv_chunk_tokens": CHUNK}
    results = {}
    for mode in ("recompute", "offload"):
        with LLM(model=tiny_llama, kv_offload="cpu", preemption_mode=mode, **pool) as llm:
            results[mode] = (generate(llm, prompts, [100] * 6), llm.stats())
    plain = generate(LLM(model=tiny_llama, **pool), prompts, [100] * 6)
    (recompute_out, recompute), (offload_out, offload) = results["recompute"], results["offload"]
    assert recompute_out == offload_out == plain
    assert recompute["num_preemptions_total"] > 0 and offload["num_preemptions_total"] > 0
    assert offload["kv_offloaded_chunks"] > 0 and recompute["kv_offloaded_chunks"] == 0
    assert offload["num_recomputed_tokens"] < recompute["num_recomputed_tokens"]


def test_decode_chunks_are_saved_with_kv_save_decode(tiny_llama, tmp_path):
    prompt = random_prompts([40], vocab_size=480, seed=5)[0]
    with LLM(model=tiny_llama, dtype="float32", kv_offload="cpu", kv_chunk_tokens=CHUNK,
             kv_save_decode=True, num_kv_blocks=64) as llm:
        output = generate(llm, [prompt], [60])[0]
        assert llm.stats()["kv_saved_chunks"] == (40 + 60 - 1) // CHUNK  # the last token has no KV
        llm.engine.kv_cache_manager.reset_prefix_cache()
        follow_up = prompt + output + [7, 8, 9]
        before = counters(llm)
        generate(llm, [follow_up], [3])
        assert delta(before, counters(llm))["kv_loaded_tokens"] == 3 * CHUNK


def test_a_corrupted_disk_record_is_recomputed_and_counted(tiny_llama, tmp_path):
    docs = random_prompts([129] * 3, vocab_size=480, seed=11)
    options = {"dtype": "float32", "kv_offload": "disk", "kv_offload_disk_path": str(tmp_path / "kv"),
               "kv_chunk_tokens": CHUNK, "num_kv_blocks": 64}
    with LLM(model=tiny_llama, **options) as llm:
        expected = one_by_one(llm, docs, 5)
    records = sorted(p for p in (tmp_path / "kv").rglob("*") if p.is_file())
    assert len(records) == 3 * 4
    victim = records[len(records) // 2]
    data = bytearray(victim.read_bytes())
    data[-100:-90] = bytes(b ^ 0xFF for b in data[-100:-90])
    victim.write_bytes(bytes(data))
    with LLM(model=tiny_llama, **options) as llm:  # a restart: the index is rebuilt from the files
        assert one_by_one(llm, docs, 5) == expected
        stats = llm.stats()
    assert stats["kv_load_failures"] == 1 and stats["kv_load_failed_tokens"] > 0
    assert stats["kv_tiers"]["disk"]["checksum_failures"] == 1
    assert stats["kv_loaded_tokens"] > 0


def test_redis_stopped_mid_run_changes_no_output(tiny_llama, redis_factory):
    server = redis_factory()
    docs = random_prompts([100] * 6, vocab_size=480, seed=13)
    options = {"dtype": "float32", "kv_offload": "redis", "kv_redis_url": server.url,
               "kv_chunk_tokens": CHUNK, "num_kv_blocks": 40, "max_num_seqs": 2, "kv_load_timeout": 1.0}
    with LLM(model=tiny_llama, **options) as llm:
        expected = one_by_one(llm, docs, 6)
    with LLM(model=tiny_llama, **options) as llm:
        engine = llm.engine
        for i, doc in enumerate(docs):
            engine.add_request(f"r{i}", doc, greedy(6))
        outputs = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            if outputs and server.proc.poll() is None:
                server.kill()  # the first requests loaded from Redis, the others cannot
        stats = llm.stats()
    assert [outputs[f"r{i}"] for i in range(len(docs))] == expected
    assert 0 < stats["kv_loaded_tokens"] < 6 * 96
    assert stats["kv_tiers"]["redis"]["errors"] > 0


def test_admin_methods_pin_unpin_flush(tiny_llama, tmp_path):
    prompt = random_prompts([100], vocab_size=480, seed=17)[0]
    with LLM(model=tiny_llama, dtype="float32", kv_offload="cpu,disk", kv_chunk_tokens=CHUNK,
             kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        engine = llm.engine
        pinned = engine.kv_pin(prompt, ttl=30)  # before anything is stored: pinned when saved
        assert (pinned["pinned_chunks"], pinned["pinned_tokens"], pinned["stored_chunks"]) == (3, 3 * CHUNK, 0)
        generate(llm, [prompt], [2])
        assert engine.kv_flush().result(timeout=60) == {"cpu": 0, "disk": 0}
        assert engine.kv_unpin(prompt) == {"unpinned_chunks": 3}
        assert engine.kv_flush(["cpu"]).result(timeout=60) == {"cpu": 3}
        assert engine.kv_pin(prompt, cache_salt="other")["pinned_chunks"] == 3
        assert set(engine.kv_store_stats()) == {"cpu", "disk"}
    plain = LLM(model=tiny_llama, dtype="float32")
    for call in (lambda: plain.engine.kv_pin(prompt), lambda: plain.engine.kv_unpin(prompt),
                 plain.engine.kv_flush, plain.engine.kv_store_stats):
        with pytest.raises(KVStoreNotConfiguredError):
            call()
    plain.close()


def test_cpu_disk_works_with_no_other_flag(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with LLM(model=tiny_llama, dtype="float32", kv_offload="cpu,disk") as llm:
        generate(llm, random_prompts([300], vocab_size=480), [2])
    assert len(list((tmp_path / "cache" / "kvtier" / "kv").rglob("*"))) > 0


def test_a_store_that_cannot_work_is_a_config_error(tiny_llama):
    with pytest.raises(ConfigError, match=r"^kv_offload_cpu_size: cpu tier of 1000 bytes"):
        LLM(model=tiny_llama, dtype="float32", kv_offload="cpu", kv_offload_cpu_size="1000B")
