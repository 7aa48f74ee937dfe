"""Every documented bad input gets its status and an OpenAI-style error body."""

from __future__ import annotations

import json

import pytest

from tests.server.server_helpers import MAX_MODEL_LEN, MODEL_NAME, RawConnection

pytestmark = pytest.mark.timeout(60)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
OK_PROMPT = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (path, body, status, param, code)
CASES = [
    (COMPLETIONS, {**OK_PROMPT, "model": "gpt-nope"}, 404, "model", "model_not_found"),
    (CHAT, {**OK_CHAT, "model": "gpt-nope"}, 404, "model", "model_not_found"),
    (COMPLETIONS, {"model": MODEL_NAME}, 400, "prompt", "missing_required_parameter"),
    (CHAT, {"model": MODEL_NAME}, 400, "messages", "missing_required_parameter"),
    (COMPLETIONS, [1, 2, 3], 400, None, "invalid_type"),
    (COMPLETIONS, {**OK_PROMPT, "max_tokens": "5"}, 400, "max_tokens", "invalid_type"),
    (COMPLETIONS, {**OK_PROMPT, "temperature": "hot"}, 400, "temperature", "invalid_type"),
    (COMPLETIONS, {**OK_PROMPT, "stream": "yes"}, 400, "stream", "invalid_type"),
    (COMPLETIONS, {**OK_PROMPT, "prompt": 42}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "prompt": [1, True]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "prompt": []}, 400, "prompt", "invalid_value"),
    (CHAT, {**OK_CHAT, "messages": "hi"}, 400, "messages", "invalid_type"),
    (CHAT, {**OK_CHAT, "messages": []}, 400, "messages", "invalid_value"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "invalid_value"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": 7}]}, 400, "messages.0.content", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "temperature": 2.5}, 400, "temperature", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "top_p": 0}, 400, "top_p", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "top_k": -2}, 400, "top_k", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "min_p": 1.5}, 400, "min_p", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    (CHAT, {**OK_CHAT, "max_completion_tokens": -1}, 400, "max_completion_tokens", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "seed": -1}, 400, "seed", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "logprobs": 21}, 400, "logprobs", "invalid_value"),
    (CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "invalid_value"),
    (CHAT, {**OK_CHAT, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "stop": ["", "x"]}, 400, "stop", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "n": 0}, 400, "n", "invalid_value"),
    (CHAT, {**OK_CHAT, "n": 129}, 400, "n", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "best_of": 2}, 400, "best_of", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "frequency_penalty": 0.5}, 400, "frequency_penalty", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "prompt": [1, 10**6]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "prompt": [5] * (MAX_MODEL_LEN + 1)}, 400, "prompt", "context_length_exceeded"),
    (COMPLETIONS, {**OK_PROMPT, "max_tokens": MAX_MODEL_LEN}, 400, "prompt", "context_length_exceeded"),
    (CHAT, {**OK_CHAT, "max_tokens": 10**9}, 400, "messages", "context_length_exceeded"),
    (COMPLETIONS, {**OK_PROMPT, "prompt": ["x"] * 65}, 400, "prompt", "too_many_prompts"),
    # lone UTF-16 surrogates: valid JSON, not valid Unicode (no tokenizer takes them)
    (COMPLETIONS, {**OK_PROMPT, "prompt": "\ud800"}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "prompt": ["fine", "x\udfff"]}, 400, "prompt", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "stop": ["\udc00"]}, 400, "stop", "invalid_value"),
    (COMPLETIONS, {**OK_PROMPT, "cache_salt": "\ud83d"}, 400, "cache_salt", "invalid_value"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages.0.content",
     "invalid_value"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udbff"}]}]},
     400, "messages.0.content", "invalid_value"),
    (CHAT, {**OK_CHAT, "messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}, 400,
     "messages.0.name", "invalid_value"),
]


def assert_error_body(response, status: int, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["param"] == param
    assert error["code"] == code
    return error


@pytest.mark.parametrize(("path", "body", "status", "param", "code"), CASES)
def test_bad_request_gets_openai_error(http, path, body, status, param, code):
    raw = json.dumps(body).encode()  # ASCII with \u escapes: lone surrogates survive
    response = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error_body(response, status, param, code)


@pytest.mark.parametrize("raw", [b"{not json", b"", b'{"prompt": "x"', "\u00e9".encode("latin-1")])
def test_invalid_json(http, raw):
    response = http.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert_error_body(response, 400, None, "invalid_json")


def test_oversized_body_is_refused_by_length_and_when_chunked(http):
    big = json.dumps({**OK_PROMPT, "prompt": "x" * 70_000}).encode()
    assert_error_body(http.post(COMPLETIONS, content=big), 413, None, "request_too_large")

    def chunks():
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    assert_error_body(http.post(COMPLETIONS, content=chunks()), 413, None, "request_too_large")


def test_unknown_route_and_wrong_method(http):
    error = assert_error_body(http.get("/v1/nothing"), 404)
    assert error["type"] == "not_found_error"
    assert_error_body(http.get(COMPLETIONS), 405)


def test_errors_leave_the_server_serving(http):
    response = http.post(COMPLETIONS, json={**OK_PROMPT, "ignore_eos": True})
    assert response.status_code == 200
    assert response.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("path", "body"), [
    (COMPLETIONS, b'{"prompt": "\\ud800", "max_tokens": 2}'),
    (CHAT, b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'),
])
def test_a_lone_surrogate_keeps_the_connection_alive(server, path, body):
    connection = RawConnection(server.url)
    try:
        status, error = connection.post(path, body)
        assert status == 400 and json.loads(error)["error"]["code"] == "invalid_value"
        status, ok = connection.post(COMPLETIONS, json.dumps({**OK_PROMPT, "ignore_eos": True}).encode())
        assert status == 200 and json.loads(ok)["usage"]["completion_tokens"] == 2
    finally:
        connection.close()
