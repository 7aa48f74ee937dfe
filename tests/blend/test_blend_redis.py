"""Segments in Redis are shared across instances: what one engine's segment prefills
saved, another engine's segment prefills load (a real redis-server; tiny model, fp32)."""

from __future__ import annotations

from engine import LLM
from tests.blend.test_blend_engine import Corpus, blend_stats, generate


def test_segments_saved_by_one_instance_are_loaded_by_another(tiny_model_factory, redis_url):
    checkpoint = tiny_model_factory(num_hidden_layers=4)
    corpus = Corpus(seed=5)
    options = {"model": checkpoint, "dtype": "float32", "num_kv_blocks": 256, "kv_offload": "redis",
               "kv_redis_url": redis_url, "kv_chunk_tokens": 32}
    with LLM(**options) as writer:
        generate(writer, corpus.segments([0, 1, 2]))
        assert blend_stats(writer)["kv_blend_reused_tokens_computed"] > 0
    with LLM(**options) as reader:  # shares nothing with the writer but Redis
        answer = generate(reader, corpus.segments([2, 0, 1], question=1))
        stats = reader.stats()
    with LLM(model=checkpoint, dtype="float32", num_kv_blocks=256) as alone:
        expected = generate(alone, corpus.segments([2, 0, 1], question=1))
    assert stats["kv_blend_reused_tokens_store"] > 0
    assert stats["kv_external_hit_tokens_redis"] > 0
    # every segment came from Redis but the last block of the one of 64 tokens: a
    # prompt's last token is always computed, here by that segment's prefill
    assert stats["kv_blend_reused_tokens_computed"] <= 16
    assert answer.outputs[0].token_ids == expected.outputs[0].token_ids
