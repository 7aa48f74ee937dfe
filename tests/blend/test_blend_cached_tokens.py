"""`num_cached_tokens` of a blended request (the server's
`usage.prompt_tokens_details.cached_tokens`) counts the prompt tokens whose KV was loaded,
from the device cache or a store tier, never those its own segment prefills computed
(issue 44, item 8)."""

from __future__ import annotations

import pytest

from engine import LLM
from tests.blend.test_blend_engine import Corpus, blend_stats, generate, make_llm


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory) -> str:
    return tiny_model_factory(num_hidden_layers=4)


def _loaded_tokens(before: dict[str, int], after: dict[str, int]) -> int:
    """What the blender's counters say the request found stored: its prefix hit and the
    reused tokens whose KV was on the device or in a tier when it came."""
    def delta(key: str) -> int:
        return after[key] - before[key]

    computed = delta("kv_blend_reused_tokens_computed")
    return delta("kv_blend_prefix_hit_tokens") + delta("kv_blend_reused_tokens") - computed


def test_a_cold_blended_request_reports_no_cached_tokens(checkpoint):
    corpus = Corpus()
    with make_llm(checkpoint) as llm:
        cold = generate(llm, corpus.segments([0, 1, 2]))
        stats = blend_stats(llm)
    assert stats["kv_blend_requests"] == 1 and stats["kv_blend_reused_tokens_computed"] > 0
    assert stats["kv_blend_prefix_hit_tokens"] > 0  # the system prompt's block, computed by its prefill
    assert cold.metrics.num_cached_tokens == 0


def test_a_warm_blended_request_reports_what_it_found_stored(checkpoint):
    corpus = Corpus()
    with make_llm(checkpoint) as llm:
        generate(llm, corpus.segments([0, 1, 2]))
        before = blend_stats(llm)
        warm = generate(llm, corpus.segments([2, 0, 1], question=1))
        after = blend_stats(llm)
    assert after["kv_blend_segment_prefills"] == before["kv_blend_segment_prefills"]  # all on the device
    assert warm.metrics.num_cached_tokens == _loaded_tokens(before, after) > 0


def test_a_request_with_one_new_document_counts_the_stored_ones_only(checkpoint):
    corpus = Corpus()
    with make_llm(checkpoint) as llm:
        generate(llm, corpus.segments([0, 1]))
        before = blend_stats(llm)
        mixed = generate(llm, corpus.segments([1, 3, 0], question=2))  # document 3 is new
        after = blend_stats(llm)
    new_reused = after["kv_blend_reused_tokens_computed"] - before["kv_blend_reused_tokens_computed"]
    assert new_reused > 0  # the new document's KV was computed by its prefill, then reused
    assert mixed.metrics.num_cached_tokens == _loaded_tokens(before, after) > 0
    assert mixed.metrics.num_cached_tokens <= len(mixed.prompt_token_ids) - len(corpus.docs[3])


def test_a_plain_request_still_counts_its_prefix_hit(checkpoint):
    corpus = Corpus()
    with LLM(model=checkpoint, dtype="float32", num_kv_blocks=256) as llm:
        generate(llm, corpus.plain([0, 1]))
        again = generate(llm, corpus.plain([0, 1]))
    assert again.metrics.num_cached_tokens == (len(again.prompt_token_ids) - 1) // 16 * 16


def test_segments_loaded_from_a_tier_are_cached_tokens(checkpoint, tmp_path):
    corpus = Corpus(seed=3)
    options = {"model": checkpoint, "dtype": "float32", "num_kv_blocks": 256, "kv_offload": "cpu,disk",
               "kv_offload_cpu_size": "64MiB", "kv_offload_disk_path": str(tmp_path), "kv_chunk_tokens": 32}
    with LLM(**options) as writer:
        generate(writer, corpus.segments([0, 1, 2]))
    with LLM(**options) as reader:  # shares only the disk directory with the writer
        before = blend_stats(reader)
        answer = generate(reader, corpus.segments([2, 0, 1], question=1))
        after = blend_stats(reader)
        loaded = reader.stats()["kv_external_hit_tokens_disk"]
    assert after["kv_blend_reused_tokens_disk"] > 0 and loaded > 0
    assert answer.metrics.num_cached_tokens == _loaded_tokens(before, after) > 0
