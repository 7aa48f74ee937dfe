"""Request bodies: big ones are decoded and validated off the event loop, with the same
400s as FastAPI's own body parsing."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Annotated

import httpx
import pytest
from fastapi import Depends, FastAPI

from engine.server import request_body
from engine.server.errors import install_error_handlers
from engine.server.protocol import CompletionRequest


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(body: Annotated[CompletionRequest, Depends(request_body.json_body(CompletionRequest))]) -> dict:
        return {"prompt_chars": len(body.prompt[0])}

    return app


def _post(content: bytes) -> httpx.Response:
    return asyncio.run(_post_async(content))


async def _post_async(content: bytes) -> httpx.Response:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post("/v1/completions", content=content, headers={"Content-Type": "application/json"})


def _body(prompt_chars: int) -> bytes:
    return json.dumps({"model": "m", "prompt": "x" * prompt_chars, "max_tokens": 1}).encode()


@pytest.mark.parametrize("prompt_chars, off_loop", [(100, False), (2 * request_body.THREAD_PARSE_BYTES, True)])
def test_big_bodies_are_parsed_in_a_worker_thread(monkeypatch, prompt_chars, off_loop):
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
