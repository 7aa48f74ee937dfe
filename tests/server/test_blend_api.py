"""Segmented prompts over HTTP (engine/blend): the completions `segments` field and the
`kv_blend_separator` field of completions and chat, their validation, and the
`kvtier:blend_*` metrics. The shared server's tiny model has two layers, whose blend
recomputes every token that a third layer would read (the check layer is its last), so
its blended answers equal the plain prompt's."""

from __future__ import annotations

import pytest

from engine import SamplingParams
from tests.server.server_helpers import MODEL_NAME, scrape, value

pytestmark = pytest.mark.timeout(60)

SYSTEM = "You answer from the documents. "
DOCS = ["The first document is about cats and their long naps in the sun. ",
        "The second document is about ships sailing across the northern sea. "]
QUESTION = "Which animal naps?"
SEP = "<|seg|>"


def segment_tokens(offline_llm, parts: list[str], first_special: bool = True) -> list[int]:
    """The prompt tokens of a segmented prompt: each part tokenized on its own."""
    tokenizer = offline_llm.tokenizer
    tokens: list[int] = []
    for i, part in enumerate(parts):
        tokens += tokenizer.encode(part, add_special_tokens=first_special and i == 0)
    return tokens


def plain_answer(offline_llm, tokens: list[int], max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return offline_llm.generate([tokens], params, use_tqdm=False)[0].outputs[0].text


def completion(http, **body):
    return http.post("/v1/completions", json={"model": MODEL_NAME, "max_tokens": 6, "temperature": 0,
                                              "ignore_eos": True, **body})


def test_segments_field_blends_and_answers_like_the_plain_prompt(http, offline_llm):
    before = scrape(http)
    parts = [SYSTEM, *DOCS, QUESTION]
    response = completion(http, segments=parts)
    assert response.status_code == 200, response.text
    body = response.json()
    tokens = segment_tokens(offline_llm, parts)
    assert body["usage"]["prompt_tokens"] == len(tokens)
    assert body["choices"][0]["text"] == plain_answer(offline_llm, tokens, 6)
    after = scrape(http)
    assert value(after, "kvtier:blend_requests") - value(before, "kvtier:blend_requests") == 1
    assert value(after, "kvtier:blend_prompt_tokens") - value(before, "kvtier:blend_prompt_tokens") == len(tokens)
    assert value(after, "kvtier:blend_segment_prefills") > value(before, "kvtier:blend_segment_prefills")
    assert {s.labels["source"] for s in after["kvtier:blend_reused_tokens"].samples} == {
        "device", "cpu", "disk", "redis", "computed"}


def test_token_id_segments_are_accepted(http, offline_llm):
    parts = [segment_tokens(offline_llm, [p], first_special=False) for p in (SYSTEM, DOCS[1], QUESTION)]
    response = completion(http, segments=parts)
    assert response.status_code == 200, response.text
    flat = [t for part in parts for t in part]
    assert response.json()["choices"][0]["text"] == plain_answer(offline_llm, flat, 6)


def test_a_separator_splits_a_completion_prompt(http, offline_llm):
    before = value(scrape(http), "kvtier:blend_requests")
    response = completion(http, prompt=SEP.join([SYSTEM, *DOCS[::-1], QUESTION]), kv_blend_separator=SEP)
    assert response.status_code == 200, response.text
    tokens = segment_tokens(offline_llm, [SYSTEM, *DOCS[::-1], QUESTION])
    assert response.json()["usage"]["prompt_tokens"] == len(tokens)  # the separator is not in the prompt
    assert response.json()["choices"][0]["text"] == plain_answer(offline_llm, tokens, 6)
    assert value(scrape(http), "kvtier:blend_requests") == before + 1


def test_a_separator_splits_chat_messages(http):
    before = value(scrape(http), "kvtier:blend_requests")
    response = http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "max_tokens": 4, "kv_blend_separator": SEP,
        "messages": [{"role": "system", "content": SYSTEM},
                     {"role": "user", "content": SEP + SEP.join(DOCS) + SEP + QUESTION}],
    })
    assert response.status_code == 200, response.text
    assert value(scrape(http), "kvtier:blend_requests") == before + 1


def test_a_prompt_without_the_separator_is_not_blended(http):
    before = value(scrape(http), "kvtier:blend_requests")
    assert completion(http, prompt=SYSTEM + QUESTION, kv_blend_separator=SEP).status_code == 200
    assert value(scrape(http), "kvtier:blend_requests") == before


@pytest.mark.parametrize("body, param", [
    ({"prompt": "both", "segments": ["a", "b"]}, None),
    ({}, "prompt"),  # neither: prompt is the missing field, as without segments
    ({"segments": []}, "segments"),
    ({"segments": ["text", [5, 6]]}, "segments"),
    ({"segments": "one string"}, "segments"),
    ({"segments": ["x"] * 65}, "segments"),
    ({"segments": [[], []]}, "segments"),
    ({"prompt": "a", "kv_blend_separator": ""}, "kv_blend_separator"),
])
def test_bad_segment_bodies_are_refused(http, body, param):
    response = completion(http, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
