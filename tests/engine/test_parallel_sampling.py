"""n > 1: the n sequences of one prompt share its prompt blocks (forked after the first
sequence's prefill), report as one output of n completions, and free every block."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams

BLOCK = 16
PROMPT = list(range(5, 5 + 3 * BLOCK + 5))  # three full blocks and a partial one


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-cache", "no-prefix-cache"])
def llm(request, tiny_model_factory):
    return LLM(model=tiny_model_factory(), dtype="float32", num_kv_blocks=64, max_model_len=256,
               block_size=BLOCK, enable_prefix_caching=request.param)


def test_greedy_sequences_equal_the_single_one(llm):
    [single] = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0))
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, n=3))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 3
    assert [c.text for c in out.outputs] == [single.outputs[0].text] * 3
    assert out.finished


def test_seeded_sequences_are_reproducible_and_differ(llm):
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=7, n=4)
    first = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    second = [c.token_ids for c in llm.generate([PROMPT], params)[0].outputs]
    assert first == second
    assert len({tuple(t) for t in first}) > 1
    # sequence 0 is the request with the seed itself
    [alone] = llm.generate([PROMPT], SamplingParams(max_tokens=10, temperature=1.0, seed=7))
    assert first[0] == alone.outputs[0].token_ids


def test_followers_share_the_prompt_blocks_and_compute_only_the_last_partial_one(llm):
    engine = llm.engine
    prompt = [t + 100 for t in PROMPT]  # never seen before: no prefix-cache hit
    engine.add_request("fork", prompt, SamplingParams(max_tokens=8, temperature=0, n=3))
    computed: dict[str, int] = {}
    tables = {}
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        for request, num_new in zip(out.requests, out.num_new_tokens, strict=True):
            computed[request.request_id] = computed.get(request.request_id, 0) + num_new
        tables.update({r: list(t) for r, t in engine.kv_cache_manager.req_to_blocks.items()})
        sampled, failures = engine._execute(out)
        assert not failures
        engine.scheduler.update_from_output(out, sampled)
        for request in out.requests:
            tracked = engine._tracked.get(request.request_id)
            if tracked is not None and request.request_id in sampled:
                engine._output_for(tracked)
    shared = [b.block_id for b in tables["fork/0"][:3]]
    for follower in ("fork/1", "fork/2"):
        assert [b.block_id for b in tables[follower][:3]] == shared
        assert tables[follower][3] is not tables["fork/0"][3]  # its own partial block
        # the partial block's 5 prompt tokens, then one token per decode step
        assert computed[follower] == 5 + 7
    assert computed["fork/0"] == len(prompt) + 7
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


@pytest.mark.parametrize("steps", [0, 1, 3])
def test_abort_frees_every_block(llm, steps):
    engine = llm.engine
    engine.add_request("abort-me", PROMPT, SamplingParams(max_tokens=50, temperature=0, n=4))
    for _ in range(steps):
        engine.step()
    engine.abort_request(["abort-me"])
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    engine.add_request("abort-me", PROMPT, SamplingParams(max_tokens=2, temperature=0, n=2))  # id reusable
    while engine.has_unfinished_requests():
        engine.step()


def test_n_with_logprobs_and_several_prompts(llm):
    outs = llm.generate([PROMPT, PROMPT[:20]], SamplingParams(max_tokens=4, temperature=0, n=2, logprobs=2))
    for out in outs:
        assert len(out.outputs) == 2
        for completion in out.outputs:
            assert len(completion.logprobs) == len(completion.top_logprobs) == 4
            assert all(len(top) == 2 and top[0][0] == t for top, t in zip(completion.top_logprobs,
                                                                             completion.token_ids, strict=True))


@pytest.mark.parametrize("offload", [(), ("cpu",)], ids=["recompute", "cpu-offload"])
def test_sequences_survive_preemption_and_the_store(tiny_model_factory, offload):
    """A pool too small for the n sequences at once: they preempt each other (offloaded
    to the cpu tier or recomputed) and still equal the single greedy sequence."""
    options = dict(kv_offload=offload, kv_offload_cpu_size="16MiB", kv_chunk_tokens=32) if offload else {}
    with LLM(model=tiny_model_factory(), dtype="float32", num_kv_blocks=10, max_model_len=256,
             block_size=BLOCK, max_num_seqs=4, **options) as llm:
        [single] = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        [out] = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, n=4))
        assert llm.stats()["num_preemptions_total"] > 0
        assert [c.token_ids for c in out.outputs] == [single.outputs[0].token_ids] * 4
        assert llm.engine.kv_cache_manager.num_free_blocks == llm.engine.num_kv_blocks
