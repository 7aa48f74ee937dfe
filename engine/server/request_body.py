"""JSON request bodies decoded and validated in a worker thread, off the event loop.

Decoding and validating a body of several MB holds the GIL for tens of milliseconds in
one C call each. On the event loop that stalls every stream the server is sending
for the whole time; in a worker thread the loop runs between the two calls and the
rest of the request's work, so a big upload costs a running stream at most one call's
worth of delay. Small bodies are parsed in place: a thread hop costs more than they do.

A worker thread still needs a core, and the engine's torch ops use them all: a big body is
decoded on a core the engine lends for it (`AsyncEngine.lend_core`, given to `json_body`
as `lend_core`), so the engine's steps slow down by one thread instead of stalling.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from engine.server.errors import APIError

M = TypeVar("M", bound=BaseModel)
# Bodies above this many bytes are parsed in a worker thread.
THREAD_PARSE_BYTES = 256 * 1024


def json_body(
    model: type[M],
    lend_core: Callable[[Request], AbstractAsyncContextManager[None]] = lambda request: nullcontext(),
) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency (`body: Annotated[Model, Depends(json_body(Model))]`) that
    reads the request body and validates it as `model`, raising the same errors FastAPI's
    own body parameters raise, so the server's error handlers answer them alike. A big
    body is decoded inside `lend_core(request)`."""

    async def parse(request: Request) -> M:
        raw = await request.body()
        if len(raw) < THREAD_PARSE_BYTES:
            return _validate(model, _decode(raw))
        async with lend_core(request):
            data = await asyncio.to_thread(_decode, raw)
            return await asyncio.to_thread(_validate, model, data)

    return parse


def _decode(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except UnicodeDecodeError as exc:
        raise APIError(400, f"The request body is not valid UTF-8 JSON: {exc}", code="invalid_json") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply.", code="invalid_json") from None
    except json.JSONDecodeError as exc:
        raise RequestValidationError(
            [{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
              "input": {}, "ctx": {"error": exc.msg}}]
        ) from None


def _validate(model: type[M], data: object) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
