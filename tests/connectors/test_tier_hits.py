"""Hits by the tier they came from, in the engine (issue 44, item 9): requests that wait
in the queue have their records prefetched from Redis into the cpu tier, and those hits
are Redis's, in `kv_external_hit_tokens_<tier>` and in each tier's `hit_tokens`
(kvtier:store_hit_tokens), which are one count. A real redis-server; tiny model, fp32."""

from __future__ import annotations

from offload_workloads import CHUNK, generate, random_prompts

from engine import LLM

LENGTHS = [150, 97, 260, 81]


def test_records_prefetched_from_redis_count_as_redis_hits(tiny_llama, redis_url):
    prompts = random_prompts(LENGTHS, vocab_size=480)
    options = {"dtype": "float32", "num_kv_blocks": 64, "kv_chunk_tokens": CHUNK, "kv_redis_url": redis_url,
               # a busy test host must not turn probes or reads into misses
               "kv_lookup_timeout": 30.0, "kv_redis_op_timeout": 30.0, "kv_load_timeout": 60.0}
    with LLM(model=tiny_llama, kv_offload="redis", **options) as writer:
        expected = generate(writer, prompts, [4] * len(prompts))
        assert writer.engine.connector.store.drain(30)
    # One request runs at a time: the others wait in the queue, where their records are
    # prefetched from Redis into the cpu tier, and load from there once admitted.
    with LLM(model=tiny_llama, kv_offload="cpu,redis", kv_offload_cpu_size="64MiB", max_num_seqs=1,
             **options) as reader:
        assert generate(reader, prompts, [4] * len(prompts)) == expected
        stats = reader.stats()
    assert stats["kv_prefetched_requests"] > 0
    loadable = sum((n - 1) // 16 * 16 for n in LENGTHS)  # whole blocks, never a prompt's last token
    assert stats["kv_external_hit_tokens_redis"] == loadable
    assert stats["kv_external_hit_tokens_cpu"] == 0
    tiers = stats["kv_tiers"]
    assert tiers["redis"]["hit_tokens"] == stats["kv_external_hit_tokens_redis"]
    assert tiers["cpu"]["hit_tokens"] == stats["kv_external_hit_tokens_cpu"] == 0
    assert tiers["cpu"]["hits"] == 0
