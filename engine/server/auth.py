"""`--api-key`: every /v1/ request needs `Authorization: Bearer <key>`, as in vLLM and
OpenAI, and so do /tokenize and /detokenize (vLLM serves them outside /v1, unguarded;
here they cost tokenizer work as a prompt does); /health, /ready, /load, /metrics and
/version stay open (load balancers, routers and scrapers carry no key), and /kv/ has its own admin token.
Refused requests get OpenAI's 401 body before their body is read."""

from __future__ import annotations

import hmac

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.server.errors import APIError

PROTECTED_PREFIX = "/v1/"
PROTECTED_PATHS = frozenset({"/tokenize", "/detokenize"})
CHALLENGE = {"WWW-Authenticate": "Bearer"}


def bearer_token(authorization: str) -> str | None:
    """The token of an `Authorization: Bearer <token>` header value, else None."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def api_key_error(authorization: str, api_key: str) -> APIError | None:
    """None when the header carries `api_key` (constant-time comparison); else the 401
    OpenAI answers: a missing key and a wrong one are told apart, the key is never echoed."""
    token = bearer_token(authorization)
    if token is None:
        return APIError(
            401, "You didn't provide an API key. You need to provide your API key in an "
            "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            headers=CHALLENGE,
        )
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        return APIError(401, "Incorrect API key provided.", code="invalid_api_key", headers=CHALLENGE)
    return None


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS):
            error = api_key_error(Headers(scope=scope).get("authorization", ""), self.api_key)
            if error is not None:
                await error.to_response()(scope, receive, send)
                return
        await self.app(scope, receive, send)
