"""The KV admin API under /kv/: stats, pin, unpin, flush. Mounted only with
--enable-kv-admin, and every route requires `Authorization: Bearer <--admin-token>`.

Store operations run on the engine thread (LLMEngine.kv_pin / kv_unpin / kv_flush), so
each does only bounded work there: prompts are tokenized before (PromptTokenizer, with
the prompts' length limit) and a flush is only started there; without --kv-offload they
raise KVStoreNotConfiguredError, answered with 501. Per-tier
stats come from the engine's published stats (`kv_tiers`, see metrics.py).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ValidationError

from connectors.base import KVStoreNotConfiguredError
from engine.async_engine import EngineClosedError, EngineDeadError
from engine.server.auth import CHALLENGE, bearer_token
from engine.server.errors import APIError, engine_error, validation_error
from engine.server.metrics import ENGINE_COUNTERS, ENGINE_GAUGES
from engine.server.protocol import FlushRequest, PinRequest
from engine.server.state import ServerState

M = TypeVar("M", bound=BaseModel)
# How long /kv/flush waits for the tiers' clears (the store's former blocking bound).
FLUSH_TIMEOUT_S = 30.0
T = TypeVar("T")


def require_admin_token(request: Request) -> None:
    """Refuse any request without the exact bearer token (constant-time comparison)."""
    expected: str = request.app.state.kvtier.settings.admin_token
    token = bearer_token(request.headers.get("authorization", ""))
    if token is None:
        raise APIError(401, "The KV admin API needs an `Authorization: Bearer <token>` header.",
                       type="authentication_error", code="missing_admin_token", headers=CHALLENGE)
    if not hmac.compare_digest(token.encode(), expected.encode()):
        raise APIError(401, "The admin token is not valid.", type="authentication_error",
                       code="invalid_admin_token", headers=CHALLENGE)


router = APIRouter(prefix="/kv", dependencies=[Depends(require_admin_token)])


@router.get("/stats")
async def kv_stats(request: Request) -> dict[str, Any]:
    state = _state(request)
    stats = state.engine.stats
    device_keys = (*ENGINE_GAUGES, *ENGINE_COUNTERS, "block_size")
    return {
        "device": {key: stats[key] for key in device_keys if key in stats},
        "tiers": dict(stats.get("kv_tiers") or {name: {} for name in state.kv_offload}),
        "store": "configured" if stats.get("kv_tiers") is not None else None,
        "pending_requests": state.engine.num_pending_requests,
    }


@router.post("/pin")
async def kv_pin(request: Request) -> dict[str, Any]:
    """Keep the stored chunks of a prompt's prefix resident for `ttl` seconds. The answer
    says how the prompt was tokenized and, when nothing (or not all) is held, why."""
    state = _state(request)
    body = _parse(PinRequest, await request.body())
    prefix = await _prefix(state, body)
    ttl, salt = body.ttl, body.cache_salt
    result = await _store_call(state, lambda e: e.kv_pin(prefix.token_ids, ttl, salt))
    return {"ttl": ttl, **result, "prompt_tokens": len(prefix.token_ids), "prompt_format": prefix.format}


@router.post("/unpin")
async def kv_unpin(request: Request) -> dict[str, Any]:
    state = _state(request)
    body = _parse(PinRequest, await request.body())
    prefix = await _prefix(state, body)
    salt = body.cache_salt
    return await _store_call(state, lambda e: e.kv_unpin(prefix.token_ids, salt))


@router.post("/flush")
async def kv_flush(request: Request) -> dict[str, Any]:
    """Drop the unpinned chunks of the given tiers (all when `tiers` is null). The engine
    thread only starts the flush; the clears (a Redis SCAN of the namespace) run on the
    store's upkeep thread while this call waits for them, up to FLUSH_TIMEOUT_S."""
    state = _state(request)
    body = _parse(FlushRequest, await request.body() or b"{}")
    unknown = [t for t in body.tiers or () if t not in state.kv_offload]
    if unknown:
        raise APIError(400, f"tier {unknown[0]!r} is not configured (--kv-offload)", param="tiers")
    tiers = body.tiers
    flushing = await _store_call(state, lambda e: e.kv_flush(tiers))
    try:  # on timeout wait_for cancels the wrapped future, and with it the clear
        flushed = await asyncio.wait_for(asyncio.wrap_future(flushing), FLUSH_TIMEOUT_S)
    except TimeoutError:
        raise APIError(504, f"the flush did not finish in {FLUSH_TIMEOUT_S:.0f} s and was stopped; what it "
                       "removed stays removed", type="server_error", code="flush_timeout") from None
    return {"flushed_chunks": flushed}


def _state(request: Request) -> ServerState:
    return request.app.state.kvtier


def _parse(model: type[M], raw: bytes) -> M:
    """Validate a body only after authentication (FastAPI would parse it before)."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


@dataclass(frozen=True)
class _Prefix:
    """A prompt to pin, tokenized as a request would send it: `format` is "text" (as
    /v1/completions tokenizes a string, special tokens included), "token_ids" (as given)
    or "chat" (the chat template applied as /v1/chat/completions does)."""

    token_ids: list[int]
    format: str


async def _prefix(state: ServerState, body: PinRequest) -> _Prefix:
    """Tokenize the body's prompt or messages off the engine thread, with the length
    limit of prompts (PromptTokenizer): an 8 MB prompt must neither stall the engine's
    streams nor be pinned, since no request could send it."""
    state.check_model(body.model)
    if body.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        return _Prefix(list(await state.prompts.encode_chat(messages, "messages")), "chat")
    prompt = body.prompt
    if isinstance(prompt, list) and any(t >= state.vocab_size for t in prompt):
        raise APIError(400, f"prompt token ids must be in [0, {state.vocab_size}) (the model's vocabulary)",
                       param="prompt", code="invalid_value")
    [token_ids] = await state.prompts.encode([prompt], "prompt")
    return _Prefix(list(token_ids), "text" if isinstance(prompt, str) else "token_ids")


async def _store_call(state: ServerState, fn: Callable[[Any], T]) -> T:
    try:
        return await state.engine.call(fn)
    except KVStoreNotConfiguredError as exc:
        raise APIError(501, "not available: no KV store configured", type="server_error",
                       code="kv_store_unavailable") from exc
    except (EngineClosedError, EngineDeadError) as exc:
        raise engine_error(exc, state.settings.retry_after) from exc
