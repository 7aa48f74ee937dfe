"""ASGI middleware that bounds request bodies before any route reads them: their size,
the time they take to arrive, and how many one client may be sending at once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.errors import SERVER_ERROR, APIError

CLOSE = {"Connection": "close"}  # the unread rest of a refused body cannot be skipped


class BodyLimitsMiddleware:
    """Read each request body whole before the app sees it, and refuse it when

    - it is larger than `max_bytes`, by Content-Length or, for chunked uploads, by
      counting: 413;
    - it has not fully arrived `timeout_s` seconds after the request head: 408, so a
      client that announces a body and stalls holds its connection that long at most;
    - its client address already has `max_reads_per_client` bodies on the way: 503 with
      Retry-After at once, so one host cannot hold many connections open that way.
      A body sent at network speed is read within one event-loop turn, so only slow
      senders ever count against this.

    The refusals close the connection and are counted with `on_refusal(reason)`. An
    accepted body is buffered (at most `max_bytes`) and replayed to the app."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        timeout_s: float,
        max_reads_per_client: int,
        retry_after_s: int,
        on_refusal: Callable[[str], None] = lambda reason: None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.max_reads_per_client = max_reads_per_client
        self.retry_after_s = retry_after_s
        self.on_refusal = on_refusal
        self._reading: Counter[str] = Counter()  # client host -> bodies being read

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared_length(scope) > self.max_bytes:
            await self._refuse(self._too_large(), "body_too_large", scope, receive, send)
            return
        client = scope["client"][0] if scope.get("client") else ""
        if self._reading[client] >= self.max_reads_per_client:
            error = APIError(
                503, f"This client is already sending {self._reading[client]} request bodies; "
                "retry once they have arrived.", type=SERVER_ERROR, code="too_many_uploads",
                headers={**CLOSE, "Retry-After": str(self.retry_after_s)},
            )
            await self._refuse(error, "too_many_uploads", scope, receive, send)
            return
        self._reading[client] += 1
        try:
            async with asyncio.timeout(self.timeout_s):
                body = await self._read_body(receive)
        except TimeoutError:
            error = APIError(408, f"The request body did not arrive within {self.timeout_s:g} s.",
                             code="request_timeout", headers=CLOSE)
            await self._refuse(error, "body_timeout", scope, receive, send)
            return
        finally:
            self._reading[client] -= 1
            if not self._reading[client]:
                del self._reading[client]
        if body is None:
            await self._refuse(self._too_large(), "body_too_large", scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    def _declared_length(scope: Scope) -> int:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0
        return 0

    async def _read_body(self, receive: Receive) -> list[Message] | None:
        """The body messages, or None past the limit (or if the client left)."""
        messages, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return [*messages, message]
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return None
            messages.append(message)
            if not message.get("more_body", False):
                return messages

    def _too_large(self) -> APIError:
        return APIError(
            413, f"The request body is larger than the server's limit of {self.max_bytes} bytes.",
            code="request_too_large", headers=CLOSE,
        )

    async def _refuse(self, error: APIError, reason: str, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_refusal(reason)
        await error.to_response()(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that first returns the buffered body, then defers to the real one
    (which later reports the client's disconnect)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
