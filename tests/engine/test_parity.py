"""The correctness oracle: greedy fp32 tokens equal transformers `generate`, for every
scheduling feature (chunked prefill, prefix hits, preemption)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

ARCHITECTURES = ["llama", "qwen2", "qwen3", "mistral"]
PROMPT_LENGTHS = [1, 7, 33, 150, 301, 64, 17, 260]
OUTPUT_LENGTHS = [12, 5, 20, 9, 16, 3, 24, 8]


def _prompts(vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def _shared_prefix_prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(1)
    system = [rng.randrange(3, vocab_size) for _ in range(70)]
    tails = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (5, 40, 1, 23)]
    prompts = [system + tail for tail in tails]
    return prompts + prompts[:2]


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                do_sample=False, eos_token_id=None, pad_token_id=0,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def engine_greedy(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tiny_model_factory):
    return tiny_model_factory(request.param)


@pytest.fixture(scope="module")
def reference(checkpoint):
    vocab = AutoModelForCausalLM.from_pretrained(checkpoint).config.vocab_size
    prompts = _prompts(vocab)
    return prompts, hf_greedy(checkpoint, prompts, OUTPUT_LENGTHS)


def _assert_same(actual: list[list[int]], expected: list[list[int]]) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a == e, f"prompt {i} (len {PROMPT_LENGTHS[i]}): engine {a} != transformers {e}"


def test_batch_matches_transformers(checkpoint, reference):
    prompts, expected = reference
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=256)
    _assert_same(engine_greedy(llm, prompts, OUTPUT_LENGTHS), expected)
    _assert_pool_clean(llm)


def test_chunked_prefill_matches_transformers(checkpoint, reference):
    prompts, expected = reference
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=48)
    _assert_same(engine_greedy(llm, prompts, OUTPUT_LENGTHS), expected)
    _assert_pool_clean(llm)


def test_preemption_matches_transformers(checkpoint, reference):
    prompts, expected = reference
    # 40 blocks of 16 tokens cannot hold the whole batch at once (it needs ~70).
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=40, max_num_batched_tokens=128)
    _assert_same(engine_greedy(llm, prompts, OUTPUT_LENGTHS), expected)
    assert llm.stats()["num_preemptions_total"] > 0
    _assert_pool_clean(llm)


def test_prefix_hits_match_transformers(checkpoint):
    vocab = AutoModelForCausalLM.from_pretrained(checkpoint).config.vocab_size
    prompts = _shared_prefix_prompts(vocab)
    lengths = [6, 10, 4, 8, 6, 10]
    expected = hf_greedy(checkpoint, prompts, lengths)
    llm = LLM(model=checkpoint, dtype="float32", num_kv_blocks=128)
    first = engine_greedy(llm, prompts[:1], lengths[:1])
    rest = engine_greedy(llm, prompts[1:], lengths[1:])
    assert first + rest == expected
    stats = llm.stats()
    assert stats["prefix_cache_hits"] >= 4 * 64
    _assert_pool_clean(llm)


def _assert_pool_clean(llm: LLM) -> None:
    """After every request finished: no block is referenced, all are free or cached."""
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == llm.engine.num_kv_blocks
    assert not llm.engine.has_unfinished_requests()
