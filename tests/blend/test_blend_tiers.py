"""Segments in the store tiers: what one engine's segment prefills saved is loaded by its
own later ones (cpu tier, after the device cache dropped it) and by other instances
(disk, and Redis: a real redis-server), and the reused tokens are counted by the tier
they came from. Tiny model, fp32."""

from __future__ import annotations

from engine import LLM
from tests.blend.test_blend_engine import Corpus, blend_stats, generate

TIERS = ("device", "cpu", "disk", "redis", "computed")


def reused_by_source(llm: LLM) -> dict[str, int]:
    stats = blend_stats(llm)
    by_source = {source: stats[f"kv_blend_reused_tokens_{source}"] for source in TIERS}
    assert sum(by_source.values()) == stats["kv_blend_reused_tokens"]
    return by_source


def plain_blend(checkpoint: str, prompt):
    """The blend of `prompt` on an engine without a store (every segment computed)."""
    with LLM(model=checkpoint, dtype="float32", num_kv_blocks=256) as alone:
        return generate(alone, prompt).outputs[0].token_ids


def test_segments_saved_by_one_instance_are_loaded_by_another(tiny_model_factory, redis_url):
    checkpoint = tiny_model_factory(num_hidden_layers=4)
    corpus = Corpus(seed=5)
    options = {"model": checkpoint, "dtype": "float32", "num_kv_blocks": 256, "kv_offload": "redis",
               "kv_redis_url": redis_url, "kv_chunk_tokens": 32}
    with LLM(**options) as writer:
        generate(writer, corpus.segments([0, 1, 2]))
        assert reused_by_source(writer)["computed"] > 0
    with LLM(**options) as reader:  # shares nothing with the writer but Redis
        answer = generate(reader, corpus.segments([2, 0, 1], question=1))
        by_source = reused_by_source(reader)
        stats = reader.stats()
    assert by_source["redis"] > 0 and by_source["device"] == by_source["cpu"] == by_source["disk"] == 0
    assert stats["kv_external_hit_tokens_redis"] > 0
    # every segment came from Redis but the last block of the one of 64 tokens: a
    # prompt's last token is always computed, here by that segment's prefill
    assert by_source["computed"] <= 16
    assert answer.outputs[0].token_ids == plain_blend(checkpoint, corpus.segments([2, 0, 1], question=1))


def test_reused_tokens_are_counted_by_the_tier_their_segment_came_from(tiny_model_factory, tmp_path):
    checkpoint = tiny_model_factory(num_hidden_layers=4)
    corpus = Corpus(seed=6)
    options = {"model": checkpoint, "dtype": "float32", "num_kv_blocks": 256, "kv_offload": "cpu,disk",
               "kv_offload_cpu_size": "64MiB", "kv_offload_disk_path": str(tmp_path), "kv_chunk_tokens": 32}
    prompt = corpus.segments([1, 3, 0], question=2)
    expected = plain_blend(checkpoint, prompt)
    with LLM(**options) as llm:
        generate(llm, corpus.segments([0, 1, 3]))
        first = reused_by_source(llm)
        assert first["computed"] > 0 and first["cpu"] == first["disk"] == 0
        assert llm.engine.kv_cache_manager.reset_prefix_cache()  # the segments stay in the cpu tier only
        answer = generate(llm, prompt)
        second = {k: v - first[k] for k, v in reused_by_source(llm).items()}
    assert second["cpu"] > 0 and second["device"] == second["disk"] == 0 and second["computed"] <= 16
    assert answer.outputs[0].token_ids == expected
    reordered = corpus.segments([3, 0, 1], question=1)  # not stored whole: blended from the segments
    with LLM(**options) as restarted:  # the same disk directory, an empty cpu tier
        answer = generate(restarted, reordered)
        by_source = reused_by_source(restarted)
    assert by_source["disk"] > 0 and by_source["device"] == by_source["cpu"] == 0 and by_source["computed"] <= 16
    assert answer.outputs[0].token_ids == plain_blend(checkpoint, reordered)


def cpu_disk_options(checkpoint: str, disk_path) -> dict:
    return {"model": checkpoint, "dtype": "float32", "num_kv_blocks": 256, "kv_offload": "cpu,disk",
            "kv_offload_cpu_size": "64MiB", "kv_offload_disk_path": str(disk_path), "kv_chunk_tokens": 32}


def test_a_blend_stored_whole_is_loaded_again_not_blended(tiny_model_factory, tmp_path):
    checkpoint = tiny_model_factory(num_hidden_layers=4)
    corpus = Corpus(seed=7)
    prompt = corpus.segments([2, 0, 3], question=1)
    follow_up = corpus.segments([2, 0, 3], question=3)  # the same documents, another question
    with LLM(**cpu_disk_options(checkpoint, tmp_path / "reference")) as reference:
        first = generate(reference, prompt)
        expected_follow_up = generate(reference, follow_up)  # reuses the first blend's blocks on the device
        assert blend_stats(reference)["kv_blend_requests"] == 2
    with LLM(**cpu_disk_options(checkpoint, tmp_path / "store")) as llm:
        assert generate(llm, prompt).outputs[0].token_ids == first.outputs[0].token_ids
        llm.engine.connector.store.drain(30)
        before = blend_stats(llm)
        assert llm.engine.kv_cache_manager.reset_prefix_cache()  # the blend stays in the cpu tier only
        again = generate(llm, prompt)
        after = blend_stats(llm)
        stats = llm.stats()
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert after["kv_blend_stored_requests"] - before["kv_blend_stored_requests"] == 1
    assert after["kv_blend_requests"] == before["kv_blend_requests"]  # loaded, not blended again
    assert after["kv_blend_segment_prefills"] == before["kv_blend_segment_prefills"]
    assert stats["kv_external_hit_tokens_cpu"] >= len(first.prompt_token_ids) // 32 * 32 - 32
    with LLM(**cpu_disk_options(checkpoint, tmp_path / "store")) as restarted:  # the disk records only
        answer = generate(restarted, follow_up)
        stats = restarted.stats()
    assert answer.outputs[0].token_ids == expected_follow_up.outputs[0].token_ids
    assert stats["kv_blend_stored_requests"] == 1 and stats["kv_blend_requests"] == 0
    assert stats["kv_blend_segment_prefills"] == 0 and stats["kv_external_hit_tokens_disk"] > 0


def test_an_exact_prefix_in_the_store_is_loaded_for_a_segmented_request(tiny_model_factory, tmp_path):
    checkpoint = tiny_model_factory(num_hidden_layers=4)
    corpus = Corpus(seed=8)
    with LLM(**cpu_disk_options(checkpoint, tmp_path)) as llm:
        plain = generate(llm, corpus.plain([1, 2], question=0))
        llm.engine.connector.store.drain(30)
        assert llm.engine.kv_cache_manager.reset_prefix_cache()
        segmented = generate(llm, corpus.segments([1, 2], question=0))  # the same tokens, as segments
        stats = llm.stats()
    assert segmented.outputs[0].token_ids == plain.outputs[0].token_ids  # exact, as the plain prompt
    assert stats["kv_blend_stored_requests"] == 1 and stats["kv_blend_requests"] == 0
    assert stats["kv_external_hit_tokens_cpu"] > 0


def test_a_blend_the_store_holds_in_part_is_blended(tiny_model_factory, tmp_path):
    checkpoint = tiny_model_factory(num_hidden_layers=4)
    corpus = Corpus(seed=9)
    with LLM(**cpu_disk_options(checkpoint, tmp_path)) as llm:
        generate(llm, corpus.segments([0, 1]))
        llm.engine.connector.store.drain(30)
        assert llm.engine.kv_cache_manager.reset_prefix_cache()
        answer = generate(llm, corpus.segments([0, 1, 2]))  # a third document after the stored two
        stats = llm.stats()
    assert stats["kv_blend_stored_requests"] == 0 and stats["kv_blend_requests"] == 2
    assert answer.outputs[0].token_ids == plain_blend(checkpoint, corpus.segments([0, 1, 2]))


def test_a_blend_another_instance_stored_in_redis_is_loaded_not_blended(tiny_model_factory, redis_url):
    checkpoint = tiny_model_factory(num_hidden_layers=4)
    corpus = Corpus(seed=10)
    prompt = corpus.segments([3, 1], question=2)
    options = {"model": checkpoint, "dtype": "float32", "num_kv_blocks": 256, "kv_offload": "redis",
               "kv_redis_url": redis_url, "kv_chunk_tokens": 32}
    with LLM(**options) as writer:
        first = generate(writer, prompt)
        writer.engine.connector.store.drain(30)
    with LLM(**options) as reader:  # knows nothing until it asks Redis's block index
        answer = generate(reader, prompt)
        stats = reader.stats()
    assert answer.outputs[0].token_ids == first.outputs[0].token_ids
    assert stats["kv_blend_stored_requests"] == 1 and stats["kv_blend_requests"] == 0
    assert stats["kv_blend_segment_prefills"] == 0 and stats["kv_external_hit_tokens_redis"] > 0
