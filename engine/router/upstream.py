"""The router's HTTP/1.1 client to one instance: keep-alive connections on asyncio streams,
a request's body sent as received and the answer's body handed on piece by piece as it
arrives (chunked, a Content-Length, or until the instance closes).

A general client (httpx) spends more on each request than the router may add in all: its
per-request layers (auth, redirects, the anyio backend, the pool's bookkeeping) run on
the event loop that relays every stream. Only what the router sends is needed here: a
request line, a few headers, a body; and only what instances answer is read.

`UpstreamError` from `Upstream.request` means the instance failed before the first byte
of its answer (no connection, or a connection that closed or broke before a whole
status line and headers): the router may send the request elsewhere. A connection that
waited idle in the pool may have been closed by the instance meanwhile (uvicorn closes
one idle for 5 s, `IDLE_S` keeps under that); a request that fails on a reused
connection before the answer's first byte is sent again once on a new connection, so a
closed idle connection is never taken for an instance that is down.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator, Iterable
from urllib.parse import urlsplit

CONNECT_TIMEOUT_S = 5.0
IDLE_S = 4.0  # below uvicorn's default keep-alive timeout (5 s), so the instance rarely closes one first
MAX_IDLE = 32  # idle connections kept per instance
READ_SIZE = 64 * 1024
HEAD_LIMIT = 64 * 1024  # the longest status line and headers read


class UpstreamError(Exception):
    """The instance failed: before its answer's head (from `Upstream.request`) or during
    its body (from `Answer.chunks` and `Answer.read`)."""


class _Connection:
    __slots__ = ("reader", "used", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.used = time.monotonic()

    @property
    def open(self) -> bool:
        return not (self.writer.is_closing() or self.reader.at_eof())

    def close(self) -> None:
        self.writer.transport.abort()


class Answer:
    """An instance's answer: its status and headers, then its body through `chunks()` or
    `read()`. `close()` once done with it: a fully read body leaves its connection to the
    next request, any other end closes the connection (the instance sees its client
    gone and stops the request)."""

    def __init__(self, upstream: Upstream, connection: _Connection, status: int,
                 headers: dict[bytes, bytes], framing: str, length: int, keep_alive: bool) -> None:
        self.status = status
        self.headers = headers  # lower-cased names, the last of a repeated one
        self._upstream = upstream
        self._connection: _Connection | None = connection
        self._framing = framing  # "chunked", "length" or "close"
        self._length = length
        self._keep_alive = keep_alive

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes, each piece as soon as it arrives (a chunk of a chunked body)."""
        connection = self._connection
        if connection is None:
            raise UpstreamError("the answer is closed")
        reader = connection.reader
        try:
            if self._framing == "chunked":
                while True:
                    size = int(_line(await reader.readuntil(b"\n")).split(b";", 1)[0], 16)
                    if size == 0:
                        while _line(await reader.readuntil(b"\n")):  # trailers
                            pass
                        break
                    data = await reader.readexactly(size + 2)
                    yield data[:-2]
            elif self._framing == "length":
                left = self._length
                while left:
                    data = await reader.read(min(left, READ_SIZE))
                    if not data:
                        raise asyncio.IncompleteReadError(b"", left)
                    left -= len(data)
                    yield data
            else:
                while data := await reader.read(READ_SIZE):
                    yield data
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            self.close()
            raise UpstreamError(_describe(exc)) from None
        self._release()

    async def read(self) -> bytes:
        return b"".join([chunk async for chunk in self.chunks()])

    def close(self) -> None:
        """Drop the connection unless the body was read to its end (then it is already back in the pool)."""
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def _release(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            if self._keep_alive and self._framing != "close":
                self._upstream._put(connection)
            else:
                connection.close()


class Upstream:
    """The connections to one instance at `url` (http or https, host and port)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl = ssl.create_default_context() if parts.scheme == "https" else None
        self._host_header = parts.netloc.encode()
        self._idle: list[_Connection] = []

    async def request(self, method: str, path: str, headers: Iterable[tuple[bytes, bytes]] = (),
                      body: bytes = b"") -> Answer:
        """Send the request; the answer once its status and headers arrived. Raises
        UpstreamError when the instance fails before that."""
        head = [f"{method} {path} HTTP/1.1\r\nhost: ".encode(), self._host_header,
                b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        for name, value in headers:
            head += (name, b": ", value, b"\r\n")
        head.append(b"\r\n")
        message = b"".join(head) + body
        while True:
            connection = self._take()
            reused = connection is not None
            if connection is None:
                connection = await self._connect()
            try:
                return await self._exchange(connection, method, message)
            except UpstreamError:
                if not reused:
                    raise

    async def get(self, path: str) -> tuple[int, bytes]:
        """A GET's status and whole body (raises UpstreamError)."""
        answer = await self.request("GET", path)
        try:
            return answer.status, await answer.read()
        finally:
            answer.close()

    def close(self) -> None:
        """Close the idle connections (one in use closes when its answer does)."""
        idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _take(self) -> _Connection | None:
        oldest = time.monotonic() - IDLE_S
        while self._idle:
            connection = self._idle.pop()  # the most recently used first
            if connection.open and connection.used >= oldest:
                return connection
            connection.close()
        return None

    def _put(self, connection: _Connection) -> None:
        if len(self._idle) >= MAX_IDLE or not connection.open:
            connection.close()
            return
        connection.used = time.monotonic()
        self._idle.append(connection)

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S):
                reader, writer = await asyncio.open_connection(
                    self._host, self._port, ssl=self._ssl, limit=HEAD_LIMIT)
        except (OSError, TimeoutError) as exc:
            raise UpstreamError(f"cannot connect ({_describe(exc)})") from None
        sock = writer.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # asyncio sets it already; a request's head and body must never wait for an ACK
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Connection(reader, writer)

    async def _exchange(self, connection: _Connection, method: str, message: bytes) -> Answer:
        done = False
        try:
            connection.writer.write(message)
            await connection.writer.drain()
            while True:
                head = await connection.reader.readuntil(b"\r\n\r\n")
                status, headers, version = _parse_head(head)
                if not 100 <= status < 200:
                    break  # an interim answer (100 Continue) is skipped
            answer = _answer(self, connection, method, status, headers, version)
            done = True
            return answer
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
            raise UpstreamError(f"no answer ({_describe(exc)})") from None
        finally:
            if not done:  # failed, or cancelled (a timeout, the client gone)
                connection.close()


def _answer(upstream: Upstream, connection: _Connection, method: str, status: int,
            headers: dict[bytes, bytes], version: bytes) -> Answer:
    """How the body is framed (RFC 9112, 6.3) and whether the connection stays open after it."""
    tokens = {t.strip() for t in headers.get(b"connection", b"").lower().split(b",")}
    keep_alive = b"close" not in tokens and (version == b"HTTP/1.1" or b"keep-alive" in tokens)
    length = 0
    if method == "HEAD" or status in (204, 304):
        framing = "length"
    elif b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        framing = "chunked"
    elif b"content-length" in headers:
        framing, length = "length", int(headers[b"content-length"])
        if length < 0:
            raise ValueError(f"Content-Length {length}")
    else:
        framing = "close"
    return Answer(upstream, connection, status, headers, framing, length, keep_alive)


def _parse_head(head: bytes) -> tuple[int, dict[bytes, bytes], bytes]:
    lines = head[:-4].split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    if not version.startswith(b"HTTP/1."):
        raise ValueError(f"not an HTTP/1 answer: {lines[0][:80]!r}")
    status = int(rest[:3])
    headers = {}
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon:
            raise ValueError(f"a malformed header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return status, headers, version


def _line(raw: bytes) -> bytes:
    """A line of a chunked body's framing, without its line end."""
    return raw.rstrip(b"\r\n")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, asyncio.IncompleteReadError):
        return "the connection closed"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return str(exc) or type(exc).__name__
