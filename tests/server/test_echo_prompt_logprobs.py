"""Completions `echo` (streamed and not, with and without logprobs) and vLLM's
`prompt_logprobs` in completions and chat, against the offline API on the same
checkpoint (whose prompt logprobs tests/engine/test_logprobs_api.py checks against
transformers)."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import AutoTokenizer

from engine import SamplingParams
from tests.server.server_helpers import MODEL_NAME

PROMPT = "The quick brown fox jumps over the lazy dog"
GREEDY = {"model": MODEL_NAME, "temperature": 0, "max_tokens": 5, "ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def completion(http: httpx.Client, **fields) -> dict:
    reply = http.post("/v1/completions", json={**GREEDY, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed(http: httpx.Client, path: str = "/v1/completions", **fields) -> list[dict]:
    chunks = []
    with http.stream("POST", path, json={**GREEDY, **fields, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def wire(prompt_logprobs) -> list:
    """The offline API's prompt logprobs as the server writes them (JSON object keys are strings)."""
    return [None if entries is None else {
        str(t): {"logprob": e.logprob, "rank": e.rank, "decoded_token": e.decoded_token} for t, e in entries.items()
    } for entries in prompt_logprobs]


def assert_same_prompt_logprobs(served: list, expected: list) -> None:
    assert len(served) == len(expected) and served[0] is None
    for got, want in zip(served[1:], expected[1:], strict=True):
        assert got.keys() == want.keys()
        for token, entry in got.items():
            assert entry["rank"] == want[token]["rank"] and entry["decoded_token"] == want[token]["decoded_token"]
            assert entry["logprob"] == pytest.approx(want[token]["logprob"], abs=1e-4)


def test_completion_prompt_logprobs_equal_the_offline_apis(http, offline_llm, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    [reference] = offline_llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2),
                                       use_tqdm=False)
    body = completion(http, prompt=[PROMPT, PROMPT + " again"], prompt_logprobs=2, n=2)
    assert len(body["choices"]) == 4
    for choice in body["choices"][:2]:  # prompt 0's choices
        assert_same_prompt_logprobs(choice["prompt_logprobs"], wire(reference.prompt_logprobs))
    second = body["choices"][2]["prompt_logprobs"]
    assert len(second) == len(tokenizer(PROMPT + " again").input_ids)
    assert completion(http, prompt=PROMPT)["choices"][0]["prompt_logprobs"] is None


def test_chat_prompt_logprobs_cover_the_rendered_prompt(http, offline_llm):
    messages = [{"role": "user", "content": PROMPT}]
    reply = http.post("/v1/chat/completions", json={**GREEDY, "messages": messages, "prompt_logprobs": 0})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    ids = offline_llm.engine.encode_chat(messages)
    assert body["usage"]["prompt_tokens"] == len(ids)
    [reference] = offline_llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                                       use_tqdm=False)
    assert_same_prompt_logprobs(body["prompt_logprobs"], wire(reference.prompt_logprobs))
    assert all(list(entries) == [str(t)] for entries, t in zip(body["prompt_logprobs"][1:], ids[1:], strict=True))


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),  # above --max-logprobs
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),  # as vLLM: not streamed
])
def test_bad_prompt_logprobs_are_400s(http, fields, param):
    reply = http.post("/v1/completions", json={**GREEDY, "prompt": PROMPT, **fields})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_echo_prepends_the_prompt_text_streamed_and_not(http, tokenizer):
    plain = completion(http, prompt=[PROMPT, "another"])["choices"]
    echoed = completion(http, prompt=[PROMPT, "another"], echo=True)["choices"]
    assert [c["text"] for c in echoed] == [PROMPT + plain[0]["text"], "another" + plain[1]["text"]]
    # a token prompt echoes its decoded text, special tokens included
    ids = tokenizer(" token ids").input_ids
    token_echo = completion(http, prompt=ids, echo=True)["choices"][0]["text"]
    assert token_echo == tokenizer.bos_token + " token ids" + completion(http, prompt=ids)["choices"][0]["text"]
    chunks = streamed(http, prompt=PROMPT, echo=True)
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == echoed[0]["text"]


def test_echo_with_logprobs_starts_with_the_prompt_tokens(http, offline_llm, tokenizer):
    ids = tokenizer(PROMPT).input_ids
    plain = completion(http, prompt=PROMPT, logprobs=1)["choices"][0]
    choice = completion(http, prompt=PROMPT, logprobs=1, echo=True)["choices"][0]
    logprobs = choice["logprobs"]
    [reference] = offline_llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1),
                                       use_tqdm=False)
    prompt_tokens = [tokenizer.decode([t]) for t in ids]
    assert logprobs["tokens"] == prompt_tokens + plain["logprobs"]["tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = [reference.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0]
    assert logprobs["token_logprobs"][1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    # the output tokens' as without echo (up to fp32 noise: that run's prefill hit the cache)
    assert logprobs["token_logprobs"][len(ids) :] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-4)
    for position in range(1, len(ids)):
        entries = reference.prompt_logprobs[position]
        best = next(t for t, e in entries.items() if e.rank == 1)
        top = logprobs["top_logprobs"][position]
        assert top.keys() == {tokenizer.decode([best]), prompt_tokens[position]}  # the top 1 and the token
    assert [top.keys() for top in logprobs["top_logprobs"][len(ids) :]] == [
        top.keys() for top in plain["logprobs"]["top_logprobs"]]
    # offsets run over the echoed text: prompt tokens first, then the completion's
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]
    # the stream sends the same logprobs across its chunks
    chunks = [c["choices"][0] for c in streamed(http, prompt=PROMPT, logprobs=1, echo=True) if c["choices"]]
    for key in ("tokens", "text_offset"):
        assert [v for c in chunks if c["logprobs"] for v in c["logprobs"][key]] == logprobs[key]
    streamed_logprobs = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed_logprobs[0] is None
    assert streamed_logprobs[1:] == pytest.approx(logprobs["token_logprobs"][1:], abs=1e-4)


def test_echo_gives_every_choice_its_prompt(http, tokenizer):
    """n = 2 of two prompts: four choices, each (streamed too) with its own prompt first;
    the second sequence of a prompt, which forks the first's prefill, echoes it as well."""
    prompts = [PROMPT, "Lorem ipsum dolor"]
    fields = {"prompt": prompts, "n": 2, "echo": True, "logprobs": 0, "temperature": 1.0, "seed": 3}
    body = completion(http, **fields)
    streamed_text: dict[int, str] = {}
    streamed_tokens: dict[int, list[str]] = {}
    for chunk in streamed(http, **fields):
        for choice in chunk["choices"]:
            streamed_text[choice["index"]] = streamed_text.get(choice["index"], "") + choice["text"]
            streamed_tokens.setdefault(choice["index"], []).extend(choice["logprobs"]["tokens"])
    for choice in body["choices"]:
        prompt = prompts[choice["index"] // 2]
        ids = tokenizer(prompt).input_ids
        assert choice["text"].startswith(prompt) and streamed_text[choice["index"]] == choice["text"]
        tokens = choice["logprobs"]["tokens"]
        assert tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
        assert streamed_tokens[choice["index"]] == tokens
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert None not in choice["logprobs"]["token_logprobs"][1:]
        assert choice["logprobs"]["top_logprobs"] is None  # logprobs 0: no alternatives
