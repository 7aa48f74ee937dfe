"""ASGI middleware that bounds request bodies before any route reads them."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.server.errors import APIError


class BodySizeLimitMiddleware:
    """Answer 413 to a body over `max_bytes`, by Content-Length or, for chunked uploads,
    by counting; the accepted body is buffered (at most `max_bytes`) and replayed."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self._declared_length(scope) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        body = await self._read_body(receive)
        if body is None:
            await self._too_large(scope, receive, send)
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

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413, f"The request body is larger than the server's limit of {self.max_bytes} bytes.",
            code="request_too_large",
        )
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
