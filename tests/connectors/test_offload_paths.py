"""Offload paths through the whole engine that the tier-combination tests do not take:
the other architectures (Qwen3 with head_dim != hidden / heads, Qwen2, Mistral), chunks
saved during decoding, the Redis read path under cpu and disk, lz4 records, and Redis
Cluster. Each compares greedy fp32 tokens with transformers and checks that the store
really served them."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
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

from engine import LLM
from kvstore.compression import Codec
from kvstore.record import parse_header

LENGTHS = [150, 97, 130, 70]
MAX_TOKENS = [7, 9, 6, 8]
# 24 blocks of 16 tokens hold about two of these requests: the store serves round two.
POOL = {"dtype": "float32", "num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 4,
        "kv_chunk_tokens": CHUNK}
LOADABLE = sum((n - 1) // 16 * 16 for n in LENGTHS)  # every full block before the last token


def two_rounds(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> tuple[list, list, dict]:
    """Outputs of two rounds of the same prompts (the device prefix cache reset between
    them, so round two reuses only what the store holds) and the second round's counters."""
    first = generate(llm, prompts, max_tokens)
    llm.engine.kv_cache_manager.reset_prefix_cache()
    before = counters(llm)
    second = generate(llm, prompts, max_tokens)
    return first, second, delta(before, counters(llm))


@pytest.mark.parametrize("architecture", ["qwen3", "qwen2", "mistral"])
def test_other_architectures_offload_to_cpu_and_disk(architecture, tiny_model_factory, tmp_path):
    model = tiny_model_factory(architecture)
    prompts = random_prompts(LENGTHS, vocab_size=480, seed=21)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    with LLM(model=model, **POOL, kv_offload="cpu,disk", kv_offload_disk_path=str(tmp_path / "kv")) as llm:
        spec = llm.engine.spec
        first, second, moved = two_rounds(llm, prompts, MAX_TOKENS)
    if architecture == "qwen3":
        assert spec.head_dim * spec.num_heads != spec.hidden_size
    assert first == second == expected
    assert moved["kv_loaded_tokens"] >= LOADABLE // 2
    assert moved["kv_load_failures"] == 0


def test_decode_chunks_saved_with_kv_save_decode_serve_a_follow_up(tiny_model_factory):
    model = tiny_model_factory()
    prompt = random_prompts([40], vocab_size=480, seed=23)[0]
    options = {"dtype": "float32", "kv_offload": "cpu", "kv_chunk_tokens": CHUNK, "num_kv_blocks": 64}
    with LLM(model=model, **options, kv_save_decode=True) as llm:
        answer = generate(llm, [prompt], [60])[0]
        llm.engine.kv_cache_manager.reset_prefix_cache()
        follow_up = prompt + answer + [7, 8, 9]  # the next turn of a chat: its KV was decoded
        before = counters(llm)
        reply = generate(llm, [follow_up], [12])[0]
        loaded = delta(before, counters(llm))["kv_loaded_tokens"]
    assert answer == hf_greedy(model, [prompt], [60])[0]
    assert reply == hf_greedy(model, [follow_up], [12])[0]
    assert loaded == 3 * CHUNK  # chunks 1 and 2 hold decoded tokens


def test_a_fresh_instance_reads_redis_under_empty_cpu_and_disk_tiers(tiny_model_factory, redis_url, tmp_path):
    """The second instance has its own (empty) cpu and disk tiers: every hit comes from
    Redis, then is promoted into its cpu tier. A record that a queued request's prefetch
    promoted before the request was admitted counts as a cpu hit."""
    model = tiny_model_factory()
    prompts = random_prompts(LENGTHS, vocab_size=480, seed=25)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    shared = {**POOL, "kv_offload": "cpu,disk,redis", "kv_redis_url": redis_url}
    with LLM(model=model, **shared, kv_offload_disk_path=str(tmp_path / "a")) as writer:
        assert generate(writer, prompts, MAX_TOKENS) == expected
        assert writer.engine.connector.store.drain(30)
    with LLM(model=model, **shared, kv_offload_disk_path=str(tmp_path / "b")) as reader:
        got = [generate(reader, [p], [n])[0] for p, n in zip(prompts, MAX_TOKENS, strict=True)]
        stats = reader.stats()
    assert got == expected
    assert stats["kv_loaded_tokens"] == LOADABLE
    assert stats["kv_external_hit_tokens_redis"] + stats["kv_external_hit_tokens_cpu"] == LOADABLE
    assert stats["kv_external_hit_tokens_redis"] > 0
    assert stats["kv_external_hit_tokens_disk"] == 0
    assert stats["kv_tiers"]["redis"]["bytes_read"] > 0


def test_requests_sharing_a_stored_prefix_each_load_all_of_it_when_they_come_together(tiny_model_factory, tmp_path):
    """Two requests whose prompts share a stored chunk arrive together at an instance
    that has it only on disk: the first to be admitted reads that chunk; the other waits
    for the read instead of recomputing the whole prompt."""
    model = tiny_model_factory()
    shared_prefix, *tails = random_prompts([3 * CHUNK, 40, 50], vocab_size=480, seed=27)
    prompts = [shared_prefix + tail for tail in tails]
    expected = hf_greedy(model, prompts, [5, 5])
    options = {**POOL, "kv_offload": "cpu,disk", "kv_offload_disk_path": str(tmp_path)}
    with LLM(model=model, **options) as writer:
        assert one_by_one(writer, prompts, 5) == expected
        assert writer.engine.connector.store.drain(30)
    with LLM(model=model, **options) as reader:  # an empty cpu tier: every record is on disk
        outputs = reader.generate(prompts, greedy(5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for output in outputs:  # every full block before the last token: from disk, or loaded by the other
        assert output.metrics.num_cached_tokens == (len(output.prompt_token_ids) - 1) // 16 * 16
        assert output.metrics.num_external_tokens > 0


def test_lz4_records_through_the_engine(tiny_model_factory, redis_url, tmp_path):
    model = tiny_model_factory()
    prompts = random_prompts(LENGTHS, vocab_size=480, seed=27)
    options = {**POOL, "kv_offload": "disk,redis", "kv_redis_url": redis_url, "kv_compress": "lz4",
               "kv_offload_disk_path": str(tmp_path / "kv")}
    with LLM(model=model, **options) as llm:
        first, second, moved = two_rounds(llm, prompts, MAX_TOKENS)
        assert llm.engine.connector.store.drain(30)
    records = [path.read_bytes() for path in (tmp_path / "kv").rglob("*.kvc")]
    client = redis.Redis.from_url(redis_url)
    records += [client.get(key) for key in client.keys("kvtier:*")]  # records, not block index keys
    headers = [parse_header(record) for record in records]
    assert first == second == hf_greedy(model, prompts, MAX_TOKENS)
    assert moved["kv_loaded_tokens"] >= LOADABLE // 2
    assert len(headers) >= 2 * 4 and {h.codec for h in headers} == {Codec.LZ4_PLANES}
    assert all(h.payload_len < h.raw_len for h in headers)


def test_redis_cluster_through_the_engine_and_across_instances(tiny_model_factory, redis_cluster, tmp_path: Path):
    model = tiny_model_factory()
    prompts = random_prompts(LENGTHS, vocab_size=480, seed=29)
    expected = hf_greedy(model, prompts, MAX_TOKENS)
    options = {**POOL, "kv_offload": "redis", "kv_redis_url": redis_cluster}
    with LLM(model=model, **options) as llm:
        first, second, moved = two_rounds(llm, prompts, MAX_TOKENS)
        assert llm.engine.connector.store.drain(30)
    with LLM(model=model, **options) as other:
        before = counters(other)
        third = generate(other, prompts, MAX_TOKENS)
        from_cluster = delta(before, counters(other))["kv_external_hit_tokens_redis"]
    assert first == second == third == expected
    assert moved["kv_external_hit_tokens_redis"] >= LOADABLE // 2
    assert from_cluster >= LOADABLE // 2
