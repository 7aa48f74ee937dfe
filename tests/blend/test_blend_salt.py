"""A segmented request with a cache_salt finds only its own tenant's segment KV (issue 44,
item 18): the segment lookup hashes each segment with the request's salt, as the segment
prefills that store them do. Outputs cannot show a leak (the reused KV has the same
values), so these tests read where the reused tokens came from."""

from __future__ import annotations

from engine import LLM, Segments
from tests.blend.test_blend_engine import GREEDY, Corpus, blend_stats, generate, make_llm
from tests.blend.test_blend_tiers import cpu_disk_options

DOCS = [0, 1, 2]
SEGMENTS = 1 + len(DOCS)  # the system prompt and the documents (the question is not stored)


def blend_moves(llm: LLM, prompt: Segments, cache_salt: str) -> dict[str, int]:
    """How the blend counters moved for one greedy request of `prompt`."""
    before = blend_stats(llm)
    llm.generate([prompt], GREEDY, use_tqdm=False, cache_salt=cache_salt)
    return {key: value - before[key] for key, value in blend_stats(llm).items()}


def test_a_salted_request_reuses_no_segment_of_another_tenant(tiny_model_factory):
    corpus = Corpus()
    with make_llm(tiny_model_factory(num_hidden_layers=4)) as llm:
        generate(llm, corpus.segments(DOCS))  # no salt: its segments stay on the device
        other = blend_moves(llm, corpus.segments(DOCS, question=1), "tenant-b")
        again = blend_moves(llm, corpus.segments(DOCS, question=2), "tenant-b")
    assert other["kv_blend_segment_prefills"] == SEGMENTS  # each computed again, salted
    assert other["kv_blend_reused_tokens_device"] == 0
    assert other["kv_blend_reused_tokens_computed"] == other["kv_blend_reused_tokens"] > 0
    # the same tenant finds its salted segments (the lookup is not simply off)
    assert again["kv_blend_segment_prefills"] == 0
    assert again["kv_blend_reused_tokens_device"] == again["kv_blend_reused_tokens"] > 0


def test_a_salted_request_loads_no_segment_another_tenant_stored(tiny_model_factory, tmp_path):
    corpus = Corpus(seed=3)
    options = cpu_disk_options(tiny_model_factory(num_hidden_layers=4), tmp_path)
    with LLM(**options) as writer:
        generate(writer, corpus.segments(DOCS))  # stored unsalted in the cpu and disk tiers
    with LLM(**options) as reader:  # a new instance: only the disk tier holds them
        other = blend_moves(reader, corpus.segments(DOCS, question=1), "tenant-b")
    assert other["kv_blend_segment_prefills"] == SEGMENTS
    assert other["kv_blend_reused_tokens_disk"] == 0
    assert other["kv_blend_reused_tokens_computed"] == other["kv_blend_reused_tokens"] > 0
