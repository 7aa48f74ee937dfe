"""--kv-role on a real Redis tier (tiny fp32 model): a producer saves its prompts to the
store and never loads them back, a consumer loads what another instance stored and saves
nothing; the options that cannot go with a role are refused by name."""

from __future__ import annotations

import pytest
from offload_workloads import CHUNK, one_by_one, random_prompts

from engine import LLM
from engine.config import ConfigError, EngineConfig

PROMPTS = random_prompts([200, 130], vocab_size=480, seed=31)
LOADABLE = sum((n - 1) // CHUNK * CHUNK for n in (200, 130))


def options(tiny_llama: str, redis_url: str, role: str) -> dict:
    return {"model": tiny_llama, "dtype": "float32", "kv_chunk_tokens": CHUNK, "num_kv_blocks": 64,
            "kv_offload": "redis", "kv_redis_url": redis_url, "kv_role": role}


def served_twice(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts, then again once the device cache has dropped them (only the store can
    supply them then)."""
    first = one_by_one(llm, PROMPTS, 4)
    llm.engine.kv_cache_manager.reset_prefix_cache()
    return first, one_by_one(llm, PROMPTS, 4)


@pytest.mark.parametrize("role", ["both", "producer"])
def test_a_producer_saves_its_prompts_and_computes_them_again(tiny_llama, redis_server, redis_url, role):
    with LLM(**options(tiny_llama, redis_url, role)) as llm:
        first, again = served_twice(llm)
        loaded = llm.stats()["kv_external_hit_tokens_redis"]
    assert redis_server.client().dbsize() > 0
    assert again == first
    assert loaded == (0 if role == "producer" else LOADABLE)


def test_a_consumer_loads_what_another_instance_stored_and_saves_nothing(tiny_llama, redis_server, redis_url):
    with LLM(**options(tiny_llama, redis_url, "producer")) as producer:
        expected = one_by_one(producer, PROMPTS, 4)
    stored = redis_server.client().dbsize()
    assert stored > 0
    unseen = random_prompts([150], vocab_size=480, seed=32)
    with LLM(**options(tiny_llama, redis_url, "kv_consumer")) as consumer:  # vLLM's spelling
        assert one_by_one(consumer, PROMPTS, 4) == expected
        one_by_one(consumer, unseen, 4)
        stats = consumer.stats()
    assert stats["kv_external_hit_tokens_redis"] == LOADABLE
    assert stats["kv_saved_chunks"] == 0
    assert redis_server.client().dbsize() == stored  # closing wrote out nothing either


@pytest.mark.parametrize(("given", "option"), [
    ({"kv_role": "consumer"}, "--kv-role"),
    ({"kv_role": "seller", "kv_offload": "cpu"}, "--kv-role"),
    ({"kv_role": "producer", "kv_offload": "cpu", "preemption_mode": "offload"}, "--preemption-mode"),
])
def test_a_role_that_cannot_work_is_refused(given, option):
    with pytest.raises(ConfigError, match=option):
        EngineConfig(**given)


def test_a_role_other_than_both_preempts_by_recomputing():
    assert EngineConfig(kv_offload="cpu", kv_role="producer").effective_preemption_mode == "recompute"
    assert EngineConfig(kv_offload="cpu").effective_preemption_mode == "offload"
