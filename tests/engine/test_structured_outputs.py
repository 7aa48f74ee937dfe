"""Structured outputs in the engine: every constrained output matches its schema, regex,
choice or grammar (on a random model, which left alone writes anything), the mask is what
constrains it, and cache hits do not change a constrained greedy output."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams
from engine.outputs import CompletionOutput
from engine.sampling_params import SamplingParamsError, StructuredOutputsParams
from engine.structured_output import GrammarError, apply_masks

PROMPT = "The cache keeps what was computed once, and the model reads it back"
# Bounded values: a random model may otherwise write one string until max_tokens.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1},
                   "maxItems": 3},
        "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "active", "scores", "address"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=tiny_model_factory(), dtype="float32", num_kv_blocks=128, max_model_len=512,
               block_size=16)


def constrained(max_tokens: int = 200, **constraint) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_a_random_model_left_alone_writes_no_json(llm):
    [out] = llm.generate([PROMPT], SamplingParams(max_tokens=40, temperature=0), use_tqdm=False)
    with pytest.raises(ValueError):
        json.loads(out.outputs[0].text)


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    greedy = llm.generate([PROMPT], constrained(json=PERSON), use_tqdm=False)
    sampled = llm.generate([PROMPT] * 4, [
        SamplingParams(max_tokens=200, temperature=1.0, seed=seed,
                       structured_outputs=StructuredOutputsParams(json=json.dumps(PERSON)))
        for seed in range(4)
    ], use_tqdm=False)
    texts = [o.outputs[0].text for o in greedy + sampled]
    for out in greedy + sampled:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    assert len(set(texts[1:])) > 1  # the grammar constrains, the sampler still samples


def test_each_of_n_sequences_follows_its_own_grammar(llm):
    params = SamplingParams(max_tokens=200, temperature=1.0, seed=3, n=3,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    [out] = llm.generate([PROMPT], params, use_tqdm=False)
    for completion in out.outputs:
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_json_object_regex_choice_and_grammar(llm):
    outs = llm.generate([PROMPT] * 4, [
        constrained(json_object=True),
        constrained(regex=r"[0-9]{3}-[a-z]{2,4}"),
        constrained(choice=["red alert", "green", "blue"]),
        constrained(grammar='start: "call " NAME "(" NUMBER ")"\nNAME: /[a-z]{1,5}/\nNUMBER: /[0-9]{1,3}/\n'),
    ], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    # any object: its keys and strings are unbounded, a random model may write one until max_tokens
    assert texts[0].startswith("{")
    if outs[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(texts[0]), dict)
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", texts[1])
    assert texts[2] in {"red alert", "green", "blue"}
    assert re.fullmatch(r"call [a-z]{1,5}\([0-9]{1,3}\)", texts[3])


def test_a_constrained_greedy_output_is_the_same_with_cache_hits(llm):
    prompt = "A prompt no other test sends, " + "and again " * 12  # the second run hits its blocks
    first = llm.generate([prompt], constrained(json=PERSON), use_tqdm=False)[0]
    second = llm.generate([prompt], constrained(json=PERSON), use_tqdm=False)[0]
    assert first.metrics.num_cached_tokens == 0
    assert second.metrics.num_cached_tokens > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


FORCED = 'start: "The order is confirmed and will ship soon: " DIGIT "."\nDIGIT: /[0-9]/\n'


def steps_to_finish(engine, params: SamplingParams) -> tuple[int, CompletionOutput]:
    engine.add_request("forced", PROMPT, params)
    steps, outputs = 0, []
    while engine.has_unfinished_requests():
        outputs += engine.step()
        steps += 1
    return steps, next(o for o in outputs if o.finished).outputs[0]


def test_text_the_grammar_forces_is_taken_in_one_step(llm):
    """Jump-forward: the fixed text costs one step, not one step a token; with logprobs,
    which forced tokens would not have, each token is sampled."""
    steps, out = steps_to_finish(llm.engine, constrained(grammar=FORCED))
    assert re.fullmatch(r"The order is confirmed and will ship soon: [0-9]\.", out.text)
    assert len(out.token_ids) > 10 and steps <= 4  # prefill + digit + forced text around it
    params = SamplingParams(max_tokens=200, temperature=0, logprobs=0,
                            structured_outputs=StructuredOutputsParams(grammar=FORCED))
    steps_with_logprobs, sampled = steps_to_finish(llm.engine, params)
    assert sampled.text == out.text and len(sampled.logprobs) == len(sampled.token_ids)
    assert steps_with_logprobs >= len(sampled.token_ids)
    capped = llm.generate([PROMPT], constrained(max_tokens=3, grammar=FORCED), use_tqdm=False)[0].outputs[0]
    assert len(capped.token_ids) == 3 and capped.finish_reason == "length"


def test_a_schema_that_cannot_be_compiled_is_refused_naming_it(llm):
    with pytest.raises(GrammarError, match="structured_outputs") as error:
        llm.generate([PROMPT], constrained(json={"type": "object", "properties": {"a": {"type": "strin"}}}))
    assert "strin" in str(error.value)
    with pytest.raises(GrammarError):
        llm.generate([PROMPT], constrained(regex="a(b"))
    with pytest.raises(SamplingParamsError, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a")
    assert not llm.engine.has_unfinished_requests()


def test_masks_leave_only_the_allowed_tokens_in_their_rows():
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)  # 64 tokens a row: 64..69 are never allowed
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 1] = -(2**31) + 1  # bits 0 and 31 (the sign bit): tokens 32 and 63
    apply_masks(logits, [0, 2], bitmask)
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert finite == [[0, 2], list(range(70)), [32, 63]]
