"""Blending on SmolLM2-135M-Instruct in fp32 (engine/blend): a RAG chat prompt of three
documents of real text, each marked as a segment."""

from __future__ import annotations

import pytest
import torch

from bench.text_corpus import documents
from engine import LLM, SamplingParams
from engine.blend.forward import BlendPlan, ShiftRotary, blend_prefill
from engine.blend.segments import SegmentedTokens
from engine.model_runner import allocate_kv_cache

SEPARATOR = "<kvtier-segment>"
GREEDY = SamplingParams(max_tokens=16, temperature=0)
OPTIONS = {"dtype": "float32", "num_kv_blocks": 512}


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return documents(3, 500, seed=7)


def rag_chat(texts: list[str], order: list[int], question: str) -> list[dict[str, str]]:
    docs = "".join(f"{SEPARATOR}Document:\n{texts[i]}\n\n" for i in order)
    return [{"role": "system", "content": "Answer the question from the documents."},
            {"role": "user", "content": f"{docs}{SEPARATOR}{question}"}]


def segmented(llm: LLM, texts: list[str], order: list[int], question: str) -> SegmentedTokens:
    tokens = llm.engine.encode_chat(rag_chat(texts, order, question), separator=SEPARATOR)
    assert isinstance(tokens, SegmentedTokens) and len(tokens.starts) == 5
    return tokens


def greedy(llm: LLM, prompt) -> list[int]:
    return llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_ratio_one_equals_the_full_prefill(smollm2_dir, texts):
    with LLM(model=smollm2_dir, kv_blend_recompute_ratio=1.0, **OPTIONS) as llm:
        prompt = segmented(llm, texts, [0, 1, 2], "Which modules do the documents describe?")
        blended = greedy(llm, prompt)
        full = greedy(llm, list(prompt))
        assert llm.stats()["kv_blend_requests"] == 1
    assert blended == full


def test_a_document_stored_in_one_order_is_reused_in_another(smollm2_dir, texts):
    question = "What is the first document about?"
    with LLM(model=smollm2_dir, **OPTIONS) as llm:
        greedy(llm, segmented(llm, texts, [0, 1, 2], "Summarize the documents."))
        before = llm.stats()
        again = greedy(llm, segmented(llm, texts, [2, 0, 1], question))
        after = llm.stats()
    with LLM(model=smollm2_dir, **OPTIONS) as fresh:  # the same prompt on an engine that stored nothing
        expected = greedy(fresh, segmented(fresh, texts, [2, 0, 1], question))
    assert after["kv_blend_segment_prefills"] == before["kv_blend_segment_prefills"]  # nothing computed again
    reused = after["kv_blend_reused_tokens_device"] - before["kv_blend_reused_tokens_device"]
    assert reused > 0.8 * 0.85 * sum(len(t) for t in texts) / 5  # most of the documents (>3 chars a token)
    assert again == expected


def test_a_moved_segment_equals_the_segment_computed_at_its_new_position(smollm2_dir, texts):
    """A segment computed alone from position 0 and moved to position p has the KV of the
    same segment computed alone from position p, in every layer (fp32). The tolerance is
    fp32's: a rotary angle at position p is exact to about p * 2**-24 radians, so the
    two differ by about 1e-5 of the KV's scale at p = 1000."""
    with LLM(model=smollm2_dir, **OPTIONS) as llm:
        model, spec = llm.engine.model, llm.engine.spec
        tokens = torch.tensor(llm.tokenizer.encode(texts[0], add_special_tokens=False)[:96])
        n, shift, block = len(tokens), 1000, 16
        cache = allocate_kv_cache(3 * n // block + 3, spec.num_layers, block, spec.num_kv_heads, spec.head_dim,
                                  torch.float32, torch.device("cpu"))
        rotary = ShiftRotary(model)
        empty = torch.empty(0, dtype=torch.long)

        def run(first_position: int, dest: torch.Tensor, reuse: torch.Tensor, ratio: float) -> torch.Tensor:
            plan = BlendPlan(tokens, torch.arange(first_position, first_position + n), empty, dest, reuse,
                             torch.full((n,), shift), ratio)
            with torch.inference_mode():
                blend_prefill(model, cache, plan, rotary)
            return cache[dest // block, :, :, dest % block]  # [n, layers, K/V, kv_heads, head_dim]

        at_zero, at_shift, moved = (torch.arange(i * n, (i + 1) * n) for i in range(3))
        run(0, at_zero, torch.full((n,), -1), 1.0)
        expected = run(shift, at_shift, torch.full((n,), -1), 1.0)
        got = run(shift, moved, at_zero, 0.0)  # every token moved, none recomputed
    scale = expected.abs().max()
    assert scale > 1
    assert (got - expected).abs().max() <= 2e-5 * scale
