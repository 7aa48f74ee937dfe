"""A JSON integer longer than Python's int/str conversion limit (4,300 digits) is a 400
naming the cause, in any field, whether the body is decoded on the event loop or on the
body decoder's thread, and it writes no traceback (issue 44, item 4)."""

from __future__ import annotations

import asyncio
import json
import sys

import httpx
import pytest
from fastapi import Depends, FastAPI

from engine.server import request_body
from engine.server.body_decoder import BodyDecoder
from engine.server.errors import install_error_handlers
from engine.server.protocol import ChatCompletionRequest
from tests.server.server_helpers import MODEL_NAME

HUGE = "9" * (sys.get_int_max_str_digits() + 1)
BASE = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 1}
MESSAGES = [{"role": "user", "content": "hi"}]


def _with_huge(body: dict, field: str) -> bytes:
    """`body` with `field` set to the HUGE integer (spliced in: json.dumps cannot write it)."""
    marker = "__HUGE__"
    return json.dumps({**body, field: marker}).replace(f'"{marker}"', HUGE).encode()


def _assert_refused(response: httpx.Response) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_json"
    assert f"more than {sys.get_int_max_str_digits()} digits" in error["message"]


@pytest.mark.parametrize("field", ["max_tokens", "seed", "n", "temperature", "logprobs", "prompt"])
def test_a_huge_integer_in_a_completion_is_a_400_without_a_traceback(server, http, field):
    logged = len(server.output)
    _assert_refused(http.post("/v1/completions", content=_with_huge(BASE, field),
                              headers={"Content-Type": "application/json"}))
    assert http.get("/health").status_code == 200
    assert "Traceback" not in server.output[logged:]


def test_a_huge_integer_nested_in_a_chat_request_is_a_400(server, http):
    body = json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "logit_bias": {"5": "__HUGE__"}})
    response = http.post("/v1/chat/completions", content=body.replace('"__HUGE__"', HUGE).encode(),
                         headers={"Content-Type": "application/json"})
    _assert_refused(response)


def test_a_big_body_decoded_on_the_decoder_thread_is_refused_alike():
    app = FastAPI()
    install_error_handlers(app)
    decoder = BodyDecoder()
    parse = request_body.json_body(ChatCompletionRequest, lambda request: decoder)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest = Depends(parse)) -> dict:  # noqa: B008 (FastAPI's idiom)
        return {}

    padding = "x" * request_body.THREAD_PARSE_BYTES  # pushes the body past the in-place limit
    raw = _with_huge({"model": MODEL_NAME, "messages": [{"role": "user", "content": padding}]}, "seed")

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post("/v1/chat/completions", content=raw,
                                     headers={"Content-Type": "application/json"})

    try:
        _assert_refused(asyncio.run(post()))
    finally:
        decoder.close()
