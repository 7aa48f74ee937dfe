"""ASGI middleware that bounds request bodies before any route reads them: their size,
the time they take to arrive, and how many one client may be sending at once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.errors import SERVER_ERROR, APIError

CLOSE = {"Connection": "close"}
# A body still arriving this long after its request head counts as slow. A client that
# sends at network speed is done well before, even when the event loop is busy (the head
# and the body often come in separate segments: bodies are "in flight" for a moment).
SLOW_AFTER_S = 1.0


class BodyLimitsMiddleware:
    """Read each request body whole before the app sees it, and refuse it when

    - it is larger than `max_bytes`, by Content-Length or, for chunked uploads, by
      counting: 413;
    - it has not fully arrived `timeout_s` seconds after the request head: 408, so a
      client that announces a body and stalls holds its connection that long at most;
    - it is slow (still arriving SLOW_AFTER_S after the head) while its client address
      already has `max_reads_per_client` slow bodies on the way: 503 with Retry-After,
      so one host cannot hold many connections open that way. Bodies sent at network
      speed never count.

    The 408 and 503 close the connection (a stalled body is never drained); after a 413
    the server reads and drops the rest of the body, so the client sees the answer
    instead of a reset. Every refusal is counted with `on_refusal(reason)`. An accepted
    body is buffered (at most `max_bytes`) and replayed to the app."""

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
        self._slow: Counter[str] = Counter()  # client host -> slow bodies being read

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared_length(scope) > self.max_bytes:
            await self._refuse(self._too_large(), "body_too_large", scope, receive, send)
            return
        client = scope["client"][0] if scope.get("client") else ""
        try:
            body = await self._read_in_time(client, receive)
        except _Refused as refused:
            await self._refuse(refused.error, refused.reason, scope, receive, send)
            return
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

    async def _read_in_time(self, client: str, receive: Receive) -> list[Message] | None:
        """The body, read within the time limit and the per-client limit on slow bodies."""
        reading = asyncio.ensure_future(self._read_body(receive))
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(reading), min(SLOW_AFTER_S, self.timeout_s))
            except TimeoutError:
                pass
            if self._slow[client] >= self.max_reads_per_client:
                raise _Refused("too_many_uploads", APIError(
                    503, f"This client is already sending {self._slow[client]} request bodies slowly; "
                    "retry once they have arrived.", type=SERVER_ERROR, code="too_many_uploads",
                    headers={**CLOSE, "Retry-After": str(self.retry_after_s)},
                ))
            self._slow[client] += 1
            try:
                return await asyncio.wait_for(reading, max(self.timeout_s - SLOW_AFTER_S, 0))
            except TimeoutError:
                raise _Refused("body_timeout", APIError(
                    408, f"The request body did not arrive within {self.timeout_s:g} s.",
                    code="request_timeout", headers=CLOSE,
                )) from None
            finally:
                self._slow[client] -= 1
                if not self._slow[client]:
                    del self._slow[client]
        finally:
            reading.cancel()  # no-op once it is done

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
            code="request_too_large",
        )

    async def _refuse(self, error: APIError, reason: str, scope: Scope, receive: Receive, send: Send) -> None:
        self.on_refusal(reason)
        await error.to_response()(scope, receive, send)


class _Refused(Exception):
    def __init__(self, reason: str, error: APIError) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that first returns the buffered body, then defers to the real one
    (which later reports the client's disconnect)."""
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
