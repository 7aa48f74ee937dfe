"""Workloads and helpers shared by the offload tests and their subprocess worker."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from engine import LLM, SamplingParams

CHUNK = 32  # tokens per stored chunk in these tests (2 blocks of 16)


def random_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]], max_tokens: Sequence[int], cache_salt: str | None = None) -> list[list[int]]:
    """All prompts in one batch (continuous batching); greedy tokens in prompt order."""
    params = [greedy(n) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False, cache_salt=cache_salt)
    return [o.outputs[0].token_ids for o in outputs]


def one_by_one(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt served alone, in order."""
    return [generate(llm, [p], [max_tokens])[0] for p in prompts]


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: Sequence[int]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_tokens, strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def counters(llm: LLM) -> dict[str, float]:
    """The engine's numeric stats (what deltas are taken of)."""
    return {k: v for k, v in llm.stats().items() if isinstance(v, int | float)}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0) for k, v in after.items()}
