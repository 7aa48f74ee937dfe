"""Seeded sampling through the engine, against something other than itself: a seed gives
the same tokens whatever the batch and the chunking around its request, another seed gives
others, and the draws over many seeds follow the distribution transformers computes
(temperature and top-k applied to its logits; at 0.3 the four probabilities are 0.44,
0.28, 0.20 and 0.09 against 0.31, 0.27, 0.24 and 0.19 at 1)."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

PROMPT = "The cache keeps what was computed once"
OTHERS = ["A long document comes back", "The scheduler decides which requests run in each step " * 3,
          "Numbers, names and places", "Good tools are simple to start", "x"]
SEEDS = 1000
TEMPERATURE, TOP_K = 0.3, 4  # a temperature far enough from 1 to tell apart


@pytest.fixture(scope="module")
def model(tiny_model_factory) -> str:
    return tiny_model_factory()


def seeded(seed: int, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True)


def tokens_of(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_a_seed_gives_the_same_tokens_in_any_batch_and_chunking(model):
    alone_llm = LLM(model=model, dtype="float32", num_kv_blocks=128)
    alone = tokens_of(alone_llm, [PROMPT], [seeded(1234)])[0]
    other_seed = tokens_of(alone_llm, [PROMPT], [seeded(4321)])[0]
    unseeded = [SamplingParams(max_tokens=16 + i, temperature=1.0, ignore_eos=True) for i in range(len(OTHERS))]
    batched = tokens_of(alone_llm, [*OTHERS[:2], PROMPT, *OTHERS[2:]], [*unseeded[:2], seeded(1234), *unseeded[2:]])
    chunked_llm = LLM(model=model, dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8)
    chunked = tokens_of(chunked_llm, [PROMPT, *OTHERS], [seeded(1234), *unseeded])
    assert batched[2] == chunked[0] == alone
    assert other_seed != alone and len(set(alone)) > 1


def test_draws_over_many_seeds_follow_the_transformers_distribution(model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(model).encode(PROMPT, add_special_tokens=True)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0, -1]
    top = logits.topk(TOP_K)
    expected = dict(zip(top.indices.tolist(), (top.values / TEMPERATURE).softmax(-1).tolist(), strict=True))

    llm = LLM(model=model, dtype="float32", num_kv_blocks=256)
    params = [SamplingParams(max_tokens=1, temperature=TEMPERATURE, top_k=TOP_K, seed=s) for s in range(SEEDS)]
    drawn = [tokens[0] for tokens in tokens_of(llm, [ids] * SEEDS, params)]
    assert set(drawn) <= set(expected)
    for token, p in expected.items():
        tolerance = 5 * (p * (1 - p) / SEEDS) ** 0.5  # five standard deviations
        assert abs(drawn.count(token) / SEEDS - p) <= tolerance, (token, drawn.count(token) / SEEDS, p)
