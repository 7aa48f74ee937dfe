"""SmolLM2-135M-Instruct through the engine: real chat, and greedy fp32 tokens equal to
transformers on chat prompts of 500 to 3,000 tokens of real text, without offload and
with every store tier serving what the device cache evicted."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.text_corpus import documents
from engine import LLM, SamplingParams

NEW_TOKENS = 16
QUESTIONS = ("Summarize the text above in one sentence.", "Which functions does it describe?",
             "What is the main topic?")
# characters of real text giving prompts of about 500, 1,500 and 3,000 tokens
DOCUMENT_CHARS = (1900, 5600, 11200)


def chat(document: str, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{document}\n\n{question}"}]


@pytest.fixture(scope="module")
def fp32_llm(smollm2_dir) -> Iterator[LLM]:
    """The engine of the prompts' encoding and of the no-offload comparison: one load of
    the model for both."""
    with LLM(model=smollm2_dir, dtype="float32") as llm:
        yield llm


@pytest.fixture(scope="module")
def long_prompts(fp32_llm) -> list[list[int]]:
    texts = [documents(1, chars, seed=i)[0] for i, chars in enumerate(DOCUMENT_CHARS)]
    assert len({t[:200] for t in texts}) == len(texts), "no shared prefix between prompts"
    prompts = [fp32_llm.engine.encode_chat(chat(t, q)) for t, q in zip(texts, QUESTIONS, strict=True)]
    lengths = [len(p) for p in prompts]
    assert 400 <= lengths[0] <= 700 and 2600 <= lengths[-1] <= 3200, lengths
    return prompts


@pytest.fixture(scope="module")
def expected(hf_smollm2, long_prompts) -> list[list[int]]:
    out = []
    for prompt in long_prompts:
        ids = hf_smollm2.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        out.append(ids[0, len(prompt):].tolist())
    return out


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0)
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]


def test_chat_answers_the_capital_of_france(smollm2_dir):
    """The default model, default options (bf16): real chat through LLM.chat, its prompt
    exactly transformers' rendering of SmolLM2's own chat template."""
    france = [{"role": "user", "content": "What is the capital of France?"}]
    italy = [{"role": "system", "content": "Answer in one word."},
             {"role": "user", "content": "What is the capital of Italy?"}]
    with LLM() as llm:
        [alone] = llm.chat(france, SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
        both = llm.chat([france, italy], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    expected = tokenizer.apply_chat_template(france, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert alone.prompt_token_ids == list(expected)
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\n")
    assert "Paris" in alone.outputs[0].text
    assert alone.outputs[0].finish_reason == "stop", "the chat turn ends with <|im_end|>"
    assert both[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert "Rome" in both[1].outputs[0].text


def test_gguf_file_decodes_like_transformers_loading_it(smollm2_gguf, long_prompts):
    directory, name = os.path.split(smollm2_gguf)
    reference = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    prompt = long_prompts[0]
    ids = reference.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    with LLM(model=smollm2_gguf, dtype="float32", num_kv_blocks=64) as llm:
        assert greedy(llm, [prompt]) == [ids[0, len(prompt):].tolist()]


def test_long_chat_prompts_match_transformers(fp32_llm, long_prompts, expected):
    """All three at once: chunked prefill (the 3,000-token one spans two steps) beside
    the others' decodes."""
    assert greedy(fp32_llm, long_prompts) == expected


# 200 blocks of 16 tokens hold the 3,000-token prompt but not the three together, so
# served one at a time each prompt evicts the ones before it
EVICTING_POOL = {"dtype": "float32", "num_kv_blocks": 200}


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis"])
def test_store_hits_after_eviction_match_transformers(smollm2_dir, long_prompts, expected, tier, tmp_path, request):
    options = {"kv_offload": tier, "kv_offload_disk_path": str(tmp_path / "kv")}
    if tier == "redis":
        options["kv_redis_url"] = request.getfixturevalue("redis_url")
    with LLM(model=smollm2_dir, **EVICTING_POOL, **options) as llm:
        first = [greedy(llm, [p])[0] for p in long_prompts]
        llm.engine.connector.store.drain(30)
        replayed = [greedy(llm, [p])[0] for p in long_prompts]
        hits = llm.stats()[f"kv_external_hit_tokens_{tier}"]
    assert first == expected and replayed == expected
    assert hits >= 0.8 * sum(len(p) for p in long_prompts[:2]), hits
