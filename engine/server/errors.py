"""OpenAI-style errors: every failure becomes `{"error": {"message", "type", "param", "code"}}`
with a meaningful status, whether it comes from validation, routing, the engine or a bug."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.async_engine import (
    EngineClosedError,
    EngineDeadError,
    QueueCapacityError,
    QueueFullError,
)
from engine.sampling_params import SamplingParamsError
from engine.scheduler import RequestTooLongError
from engine.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"


class APIError(Exception):
    """An error answered to the client as it is (status, OpenAI error body, headers)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def to_response(self) -> JSONResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        body = ErrorResponse(error=info).model_dump()
        return JSONResponse(body, status_code=self.status, headers=self.headers)


def too_many_prompts(count: int, limit: int) -> APIError:
    return APIError(
        400, f"A completion may hold at most {limit} prompts; this one has {count}.",
        param="prompt", code="too_many_prompts",
    )


def too_many_sequences(count: int, num_prompts: int, n: int, limit: int) -> APIError:
    return APIError(
        400, f"This request runs {count} sequences ({num_prompts} prompt(s) x n={n}); the server holds at most "
        f"{limit} at once (--max-num-seqs + --max-waiting-requests).",
        param="n", code="too_many_sequences",
    )


def model_not_found(name: str | None) -> APIError:
    return APIError(
        404, f"The model {name!r} does not exist.", param="model", code="model_not_found"
    )


def engine_error(exc: Exception, retry_after_s: int, prompt_param: str = "prompt") -> APIError | None:
    """The APIError for what `AsyncEngine.generate`/`call` raise about a request
    (`prompt_param` names the field that held the prompt); None for anything else,
    which is a bug and must surface as a 500."""
    if isinstance(exc, QueueFullError):
        return APIError(
            503, str(exc), type=SERVER_ERROR, code="queue_full",
            headers={"Retry-After": str(retry_after_s)},
        )
    if isinstance(exc, EngineClosedError):
        return APIError(503, str(exc), type=SERVER_ERROR, code="shutting_down")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type=SERVER_ERROR, code="engine_unavailable")
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, QueueCapacityError):
        return APIError(400, str(exc), param=prompt_param, code="too_many_prompts")
    if isinstance(exc, RequestTooLongError):
        return APIError(400, str(exc), param=prompt_param, code="context_length_exceeded")
    if isinstance(exc, ValueError):  # add_request's contract: ValueError means bad input
        return APIError(400, str(exc), param=prompt_param, code="invalid_value")
    return None


def validation_error(errors: Sequence[Mapping[str, Any]]) -> APIError:
    """A 400 naming the first problem pydantic (or FastAPI) found in the body."""
    first = errors[0]
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return APIError(400, f"The request body is not valid JSON: {detail}", code="invalid_json")
    path = [str(p) for p in first["loc"] if p != "body"]
    param = ".".join(path) or None
    message = first["msg"].removeprefix("Value error, ")
    if param is None and first["type"] == "missing":
        return APIError(400, "The request needs a JSON object body.", code="invalid_json")
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_value"
    if first["type"].endswith("_type"):
        code = "invalid_type"
    return APIError(400, f"{param}: {message}" if param else message, param=param, code=code)


def _http_error(exc: StarletteHTTPException) -> APIError:
    if exc.status_code == 400:  # FastAPI's only 400: a body it could not decode
        return APIError(400, f"The request body is not valid UTF-8 JSON: {exc.detail}", code="invalid_json")
    kind = "not_found_error" if exc.status_code == 404 else INVALID_REQUEST
    return APIError(exc.status_code, str(exc.detail), type=kind, headers=exc.headers)


async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.to_response()


async def _on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc.errors()).to_response()


async def _on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return _http_error(exc).to_response()


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return APIError(500, "Internal server error.", type=SERVER_ERROR).to_response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_unexpected)
