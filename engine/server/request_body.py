"""JSON request bodies: small ones decoded and validated in place, big ones on the body
decoder's thread, off the event loop.

Decoding and validating a body of several MB holds the GIL for tens of milliseconds in
one C call each. On the event loop that stalls every stream the server is sending
for the whole time; on another thread the loop runs between the two calls and the
rest of the request's work, so a big upload costs a running stream at most one call's
worth of delay, which the decoder's resident memory keeps short (engine/server/body_decoder.py).
Small bodies are parsed in place: a thread hop costs more than they do.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from engine.server.body_decoder import BodyDecoder
from engine.server.errors import APIError

M = TypeVar("M", bound=BaseModel)
# Bodies of this many bytes or more are decoded on the body decoder's thread.
THREAD_PARSE_BYTES = 256 * 1024


def json_body(model: type[M], decoder_of: Callable[[Request], BodyDecoder]) -> Callable[[Request], Awaitable[M]]:
    """A FastAPI dependency (`body: Annotated[Model, Depends(json_body(Model, ...))]`)
    that reads the request body and validates it as `model`, raising the same errors
    FastAPI's own body parameters raise, so the server's error handlers answer them alike.
    A big body is decoded by `decoder_of(request)`, on a core its `lend_core` lends."""

    async def parse(request: Request) -> M:
        raw = await request.body()
        if len(raw) < THREAD_PARSE_BYTES:
            return _validate(model, _decode(raw))
        decoder = decoder_of(request)
        async with decoder.lend_core():
            data = await decoder.run(_decode, raw)
            return await decoder.run(_validate, model, data)

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
    except ValueError:  # not a syntax error: an integer past Python's int/str conversion limit
        raise APIError(
            400, f"The request body holds an integer of more than {sys.get_int_max_str_digits()} digits.",
            code="invalid_json",
        ) from None


def _validate(model: type[M], data: object) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None
