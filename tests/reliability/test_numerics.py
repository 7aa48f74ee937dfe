"""Greedy outputs and batch composition: in fp32 a request's tokens do not depend on what
it is batched or chunked with (the guarantee every other scenario relies on); in bf16 they
may, since the rounding of each kernel depends on the batch shape. Measured, and in fp32
asserted."""

from __future__ import annotations

import random

import pytest
from reliability_support import VOCAB, wrong_outputs
from scorecard import Scorecard

from engine import LLM, SamplingParams

pytestmark = pytest.mark.timeout(180)

LENGTHS = [30, 47, 64, 81, 95, 110, 129, 18, 53, 150]
MAX_TOKENS = 16


def prompts() -> list[list[int]]:
    rng = random.Random(51)
    return [[rng.randrange(4, VOCAB) for _ in range(n)] for n in LENGTHS]


def greedy_tokens(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def differing(model: str, dtype: str) -> tuple[int, int]:
    """Requests whose tokens differ from a sequential run: (all batched at once, the same
    batched with 64-token prefill chunks)."""
    batch = prompts()
    plain = {"dtype": dtype, "num_kv_blocks": 512, "enable_prefix_caching": False}
    sequential = LLM(model=model, **plain)
    alone = [greedy_tokens(sequential, [p])[0] for p in batch]
    together = greedy_tokens(sequential, batch)
    chunked = greedy_tokens(LLM(model=model, **plain, max_num_batched_tokens=64), batch)
    return wrong_outputs(together, alone), wrong_outputs(chunked, alone)


def test_greedy_outputs_and_batch_composition(model_path: str, scorecard: Scorecard):
    fp32 = differing(model_path, "float32")
    bf16 = differing(model_path, "bfloat16")
    scorecard.add(
        "numerics", "greedy fp32 tokens, batched and chunked vs one at a time", requests=3 * len(LENGTHS),
        wrong_outputs=sum(fp32), fp32_differing_batched=fp32[0], fp32_differing_chunked=fp32[1],
        bf16_differing_batched=bf16[0], bf16_differing_chunked=bf16[1], requests_compared=len(LENGTHS),
    )
    assert fp32 == (0, 0)
