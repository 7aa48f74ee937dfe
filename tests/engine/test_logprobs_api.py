"""vLLM's logprob shapes in the `LLM` API: output logprobs as {token id: Logprob} per
token, prompt logprobs equal to a full fp32 forward of transformers (one chunk, chunked
prefill, a prefix already cached, a KV store holding the prompt), and `get_tokenizer`."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, Logprob, SamplingParams, Segments
from engine.logprobs import TokenLogprob
from engine.request import Request
from engine.sampling_params import SamplingParamsError

BLOCK = 16
BUDGET = 24  # max_num_batched_tokens: a prompt longer than this is prefilled in chunks
TOP = 3


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory) -> str:
    return tiny_model_factory()


@pytest.fixture(scope="module")
def llm(checkpoint):
    with LLM(model=checkpoint, dtype="float32", num_kv_blocks=64, max_model_len=256, block_size=BLOCK,
             max_num_batched_tokens=BUDGET, kv_offload="cpu", kv_offload_cpu_size="16MiB",
             kv_chunk_tokens=BLOCK) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(checkpoint):
    """token ids -> log_softmax of transformers' logits at every position [T, V]."""
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()

    def logprobs(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return logprobs


def _prompt(llm: LLM, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, llm.engine.spec.vocab_size) for _ in range(length)]


def assert_entries_match(entries: dict[int, Logprob], token_id: int, row: torch.Tensor, llm: LLM, k: int) -> None:
    """`entries` holds `token_id` and the k most likely tokens of `row` (reference
    logprobs of one position), with vLLM's ranks and each token's text."""
    values, ids = row.topk(k)
    assert set(entries) == {token_id, *ids.tolist()}
    token = entries[token_id]
    assert token.logprob == pytest.approx(row[token_id].item(), abs=1e-4)
    if token_id not in ids.tolist():  # its rank in the vocabulary, up to ties within fp32 noise
        value = row[token_id]
        assert int((row > value + 1e-4).sum()) < token.rank <= int((row >= value - 1e-4).sum())
    for rank, (top_id, value) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), start=1):
        assert entries[top_id].rank == rank
        assert entries[top_id].logprob == pytest.approx(value, abs=1e-4)
    tokenizer = llm.get_tokenizer()
    assert all(e.decoded_token == tokenizer.decode([t]) for t, e in entries.items())


def assert_prompt_logprobs_match(out, prompt: list[int], reference, llm: LLM) -> None:
    expected = reference(prompt)
    assert len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None
    for position in range(1, len(prompt)):
        assert_entries_match(out.prompt_logprobs[position], prompt[position], expected[position - 1], llm, TOP)


@pytest.mark.parametrize("length", [9, BUDGET * 3 + 5], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_a_full_forward(llm, reference, length):
    prompt = _prompt(llm, length, seed=length)
    [out] = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=TOP), use_tqdm=False)
    assert_prompt_logprobs_match(out, prompt, reference, llm)
    [plain] = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_are_computed_past_a_cached_prefix(llm, reference):
    """The prefix is in the device cache and in the KV store: the request asking prompt
    logprobs takes neither, and still gets every position's logprobs."""
    prefix = _prompt(llm, 3 * BLOCK, seed=1)
    prompt = prefix + _prompt(llm, 7, seed=2)
    llm.generate([[*prefix, 5]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    [cached] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert cached.metrics.num_cached_tokens == 3 * BLOCK  # the device cache holds the prefix
    before = llm.stats()
    [out] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP), use_tqdm=False)
    assert out.metrics.num_cached_tokens == 0
    # a request that does not read the cache is no query of it (as in vLLM)
    assert llm.stats()["prefix_cache_queries"] == before["prefix_cache_queries"]
    assert_prompt_logprobs_match(out, prompt, reference, llm)
    llm.engine.kv_cache_manager.reset_prefix_cache()  # now only the store has it
    [stored] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=TOP),
                            use_tqdm=False)
    assert stored.metrics.num_external_tokens == 0
    assert_prompt_logprobs_match(stored, prompt, reference, llm)


def test_prompt_logprobs_survive_preemption(checkpoint, reference):
    """12 blocks cannot hold three requests of 6: some are preempted (mid-prefill or
    later) and compute their prompt again; each still reports every position once."""
    with LLM(model=checkpoint, dtype="float32", num_kv_blocks=12, max_model_len=256, block_size=BLOCK,
             max_num_batched_tokens=BUDGET) as small:
        prompts = [_prompt(small, 70, seed=10 + i) for i in range(3)]
        params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=TOP)
        outputs = small.generate(prompts, params, use_tqdm=False)
        assert small.stats()["num_preemptions_total"] > 0
        for out, prompt in zip(outputs, prompts, strict=True):
            assert_prompt_logprobs_match(out, prompt, reference, small)


def test_a_segmented_prompt_asking_prompt_logprobs_runs_unblended(llm, reference):
    """A blend would compute only the question's rows: the request runs as its plain
    prompt instead, and gets every position's logprobs."""
    parts = [_prompt(llm, n, seed=20 + n) for n in (10, 40, 33, 6)]
    [out] = llm.generate([Segments(parts)], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=TOP),
                         use_tqdm=False)
    assert out.error is None
    assert_prompt_logprobs_match(out, [t for part in parts for t in part], reference, llm)


def test_output_logprobs_are_vllm_logprob_dicts(llm, reference):
    prompt = _prompt(llm, 20, seed=3)
    [out] = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.8, seed=4, logprobs=TOP),
                         use_tqdm=False)
    completion = out.outputs[0]
    expected = reference(prompt + completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for step, (token_id, entries) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = expected[len(prompt) - 1 + step]
        assert_entries_match(entries, token_id, row, llm, TOP)
        # the ordered top k stay available as (token id, logprob) pairs
        assert [t for t, _ in completion.top_logprobs[step]] == row.topk(TOP).indices.tolist()


def test_logprobs_zero_gives_the_sampled_token_alone(llm):
    [out] = llm.generate([_prompt(llm, 5, seed=5)], SamplingParams(max_tokens=3, temperature=0, logprobs=0),
                         use_tqdm=False)
    completion = out.outputs[0]
    assert [list(e) for e in completion.logprobs] == [[t] for t in completion.token_ids]
    assert all(e[t].rank == 1 for e, t in zip(completion.logprobs, completion.token_ids, strict=True))  # greedy


def test_parallel_sampling_reports_the_prompt_logprobs_once(llm, reference):
    prompt = _prompt(llm, 2 * BLOCK + 5, seed=6)
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=3, prompt_logprobs=TOP)
    [out] = llm.generate([prompt], params, use_tqdm=False)
    assert len(out.outputs) == 3
    assert_prompt_logprobs_match(out, prompt, reference, llm)


def test_prompt_logprobs_are_bounded_by_max_logprobs(llm):
    limit = llm.engine.config.max_logprobs
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        llm.generate([[5, 6, 7]], SamplingParams(prompt_logprobs=limit + 1), use_tqdm=False)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_a_prefill_chunk_run_again_records_its_prompt_logprobs_once():
    request = Request("r", [1, 2, 3, 4, 5], SamplingParams(prompt_logprobs=0))
    chunk = [TokenLogprob(-1.0, 1), TokenLogprob(-2.0, 2)]
    request.add_prompt_logprobs(1, chunk, [[], []])
    assert request.skip_reading_prefix_cache
    request.add_prompt_logprobs(1, [*chunk, TokenLogprob(-3.0, 3)], [[], [], []])  # recomputed after a preemption
    assert request.prompt_logprobs == [*chunk, TokenLogprob(-3.0, 3)]
    with pytest.raises(ValueError, match="from token 5"):
        request.add_prompt_logprobs(5, [TokenLogprob(-4.0, 1)], [[]])
    request.add_prompt_logprobs(4, [TokenLogprob(-4.0, 1)], [[]])
    assert request.num_prompt_logprobs_missing == 0 and not request.skip_reading_prefix_cache


def test_get_tokenizer_is_the_engines_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer is llm.engine.tokenizer
    assert tokenizer.decode(tokenizer.encode("hello world", add_special_tokens=False)) == "hello world"
