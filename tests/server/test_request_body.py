"""Request bodies: big ones are decoded and validated off the event loop, with the same
400s as FastAPI's own body parsing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import Depends, FastAPI

from engine.server import request_body
from engine.server.body_decoder import BodyDecoder
from engine.server.errors import install_error_handlers
from engine.server.protocol import CompletionRequest


class Loans:
    """A stand-in for AsyncEngine.lend_core that records what ran inside a loan."""

    def __init__(self) -> None:
        self.open = 0
        self.decoded_inside: list[bool] = []

    @contextlib.asynccontextmanager
    async def lend(self) -> AsyncIterator[None]:
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


def _app(decoder: BodyDecoder) -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    parse = request_body.json_body(CompletionRequest, lambda request: decoder)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest = Depends(parse)) -> dict:  # noqa: B008 (FastAPI's idiom)
        return {"prompt_chars": len(body.prompt[0])}

    return app


def _post(content: bytes, loans: Loans | None = None) -> httpx.Response:
    return asyncio.run(_post_async(content, loans))


async def _post_async(content: bytes, loans: Loans | None = None) -> httpx.Response:
    decoder = BodyDecoder() if loans is None else BodyDecoder(loans.lend)
    try:
        transport = httpx.ASGITransport(app=_app(decoder))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.post(
                "/v1/completions", content=content, headers={"Content-Type": "application/json"})
    finally:
        decoder.close()


def _body(prompt_chars: int) -> bytes:
    return json.dumps({"model": "m", "prompt": "x" * prompt_chars, "max_tokens": 1}).encode()


@pytest.mark.parametrize("prompt_chars, off_loop", [(100, False), (2 * request_body.THREAD_PARSE_BYTES, True)])
def test_big_bodies_are_parsed_on_the_decoder_thread(monkeypatch, prompt_chars, off_loop):
    threads = []
    decode = request_body._decode

    def recording_decode(raw: bytes) -> object:
        threads.append(threading.get_ident())
        return decode(raw)

    monkeypatch.setattr(request_body, "_decode", recording_decode)
    caller = threading.get_ident()  # asyncio.run's loop runs in this thread
    response = _post(_body(prompt_chars))
    assert response.status_code == 200
    assert response.json() == {"prompt_chars": prompt_chars}
    assert (threads != [caller]) is off_loop and len(threads) == 1


@pytest.mark.parametrize("prompt_chars, lent", [(100, False), (2 * request_body.THREAD_PARSE_BYTES, True)])
def test_big_bodies_are_decoded_on_a_lent_core(monkeypatch, prompt_chars, lent):
    loans = Loans()
    decode = request_body._decode

    def recording_decode(raw: bytes) -> object:
        loans.decoded_inside.append(loans.open == 1)
        return decode(raw)

    monkeypatch.setattr(request_body, "_decode", recording_decode)
    assert _post(_body(prompt_chars), loans).status_code == 200
    assert loans.decoded_inside == [lent]
    assert loans.open == 0


def test_a_lent_core_is_given_back_when_a_big_body_is_refused():
    loans = Loans()
    response = _post(b'{"prompt": "' + b"x" * 2 * request_body.THREAD_PARSE_BYTES, loans)
    assert response.status_code == 400
    assert loans.open == 0


@pytest.mark.parametrize("size", [10, 2 * request_body.THREAD_PARSE_BYTES])
def test_invalid_json_is_a_400_whatever_the_size(size):
    response = _post(b'{"prompt": "' + b"x" * size)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


@pytest.mark.parametrize("size", [10, 2 * request_body.THREAD_PARSE_BYTES])
def test_a_wrong_field_is_a_400_naming_it_whatever_the_size(size):
    body = json.dumps({"model": "m", "prompt": "x" * size, "max_tokens": "many"}).encode()
    response = _post(body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "max_tokens" and error["code"] == "invalid_type"


def test_invalid_utf8_is_a_400():
    response = _post(b'{"prompt": "\xff\xfe"}')
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"


def test_deeply_nested_json_is_a_400():
    response = _post(b"[" * 50_000 + b"]" * 50_000)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_json"
