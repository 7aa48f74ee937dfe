"""POST /tokenize and /detokenize: vLLM's bodies, the model's tokenizer and chat
template, a prompt's checks, and --api-key guarding them."""

from __future__ import annotations

import json

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from engine.server.auth import ApiKeyMiddleware
from tests.server.server_helpers import MAX_MODEL_LEN, MODEL_NAME

TEXT = "The quick brown fox jumps over the lazy dog. Ünïcödé too."
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there."}]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return AutoTokenizer.from_pretrained(model_path)


def test_tokenize_a_prompt_as_vllm_answers(http: httpx.Client, tokenizer):
    reply = http.post("/tokenize", json={"model": MODEL_NAME, "prompt": TEXT})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    expected = tokenizer(TEXT).input_ids  # with the special tokens the tokenizer adds (its <s>)
    assert expected[0] == tokenizer.bos_token_id
    assert body == {"count": len(expected), "max_model_len": MAX_MODEL_LEN, "tokens": expected, "token_strs": None}
    plain = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False, "return_token_strs": True})
    assert plain.json()["tokens"] == expected[1:]
    assert plain.json()["token_strs"] == tokenizer.convert_ids_to_tokens(expected[1:])


def test_detokenize_round_trips_tokenize(http: httpx.Client, tokenizer):
    tokens = http.post("/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    reply = http.post("/detokenize", json={"model": MODEL_NAME, "tokens": tokens})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": TEXT}
    with_bos = http.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": with_bos}).json()["prompt"] == tokenizer.bos_token + TEXT


def test_tokenize_messages_renders_the_chat_template(http: httpx.Client, tokenizer, offline_llm):
    reply = http.post("/tokenize", json={"model": MODEL_NAME, "messages": MESSAGES})
    assert reply.status_code == 200, reply.text
    # what a chat completion of these messages is prefilled with
    assert reply.json()["tokens"] == offline_llm.engine.encode_chat(MESSAGES)
    no_prompt = http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False}).json()
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=False, tokenize=False)
    assert no_prompt["tokens"] == tokenizer(rendered, add_special_tokens=False).input_ids
    assert no_prompt["count"] < reply.json()["count"]


@pytest.mark.parametrize(("path", "body", "param", "code"), [
    ("/detokenize", {"tokens": [5, 10**6]}, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "invalid_value"),
    ("/detokenize", {"tokens": ["5"]}, "tokens.0", "invalid_type"),
    ("/tokenize", {}, None, "invalid_value"),
    ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, None, "invalid_value"),
    ("/tokenize", {"messages": []}, None, "invalid_value"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt", "invalid_value"),
    ("/tokenize", {"prompt": "a " * MAX_MODEL_LEN}, "prompt", "context_length_exceeded"),
    ("/tokenize", {"prompt": TEXT, "model": "other"}, "model", "model_not_found"),
])
def test_bad_requests_are_openai_errors(http: httpx.Client, path, body, param, code):
    # json.dumps escapes the lone surrogate, as a client's JSON encoder sends it
    reply = http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_the_api_key_guards_tokenize_and_detokenize():
    app = FastAPI()
    app.post("/tokenize")(lambda: {"tokens": []})
    app.post("/detokenize")(lambda: {"prompt": ""})
    app.get("/health")(lambda: {})
    app.add_middleware(ApiKeyMiddleware, api_key="sk-test")
    client = TestClient(app)
    for path in ("/tokenize", "/detokenize"):
        assert client.post(path).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer sk-wrong"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer sk-test"}).status_code == 200
    assert client.get("/health").status_code == 200
