"""Pipelined GETRANGE replies received straight into caller buffers (standalone Redis).

redis-py hands every reply back as a new bytes object (its parser copies the socket's
data into a buffer, then into the bytes), which the store would then copy into its slot.
For the one bulk operation where that matters, reading records, the Redis tier uses
this reader instead: its own small pool of connections (AUTH, SELECT and TLS as the URL
says), the GETRANGE commands of a batch sent in one write, and each reply's payload
received with `recv_into` into the caller's buffer, so a record lands in the slot it is
served from with the kernel's copy only. An error reply for a key (a value of another
type under it) is a miss; other errors (a closed connection, a timeout, a malformed
reply) raise and the connection is dropped.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
from collections.abc import Sequence

from tiers.redis_url import RedisTarget

MAX_IDLE = 8
LINE_LIMIT = 64  # a bulk header is "$<length>\r\n"


class RespProtocolError(OSError):
    """Redis answered something other than the bulk replies a GETRANGE pipeline gives."""


def _command(*args: bytes) -> bytes:
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


class BulkReader:
    def __init__(self, target: RedisTarget, timeout_s: float, connect_timeout_s: float) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()

    def get_into(self, keys: Sequence[str], into: Sequence[memoryview]) -> list[int | None]:
        """GETRANGE each key into its buffer (at most the buffer's size); per key the
        bytes received, None for a missing key. Blocking; raises OSError on failure."""
        connection = self._take()
        try:
            request = b"".join(
                _command(b"GETRANGE", key.encode(), b"0", b"%d" % (buffer.nbytes - 1))
                for key, buffer in zip(keys, into, strict=True)
            )
            connection.sock.sendall(request)
            sizes = [connection.read_bulk(buffer) for buffer in into]
        except BaseException:
            connection.close()
            raise
        self._give(connection)
        return [size or None for size in sizes]  # GETRANGE answers "" for a missing key

    def close(self) -> None:
        """Drop every idle connection (the next read connects again)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for connection in idle:
            connection.close()

    def _take(self) -> _Connection:
        """An idle connection that is still open, else a new one. An idle connection that
        has something to read was closed by Redis (a restart drops every connection)."""
        while True:
            with self._lock:
                connection = self._idle.pop() if self._idle else None
            if connection is None:
                return _Connection.open(self.target, self.timeout_s, self.connect_timeout_s)
            if not connection.closed_by_peer():
                return connection
            connection.close()

    def _give(self, connection: _Connection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(connection)
                return
        connection.close()


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._pending = bytearray()  # received past the last reply read

    @classmethod
    def open(cls, target: RedisTarget, timeout_s: float, connect_timeout_s: float) -> _Connection:
        sock = _connect(target, connect_timeout_s)
        try:
            if target.socket_path is None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if target.ssl:
                sock = ssl.create_default_context().wrap_socket(sock, server_hostname=target.nodes[0][0])
            sock.settimeout(timeout_s)
            connection = cls(sock)
            if target.password is not None:
                user = [target.username.encode()] if target.username else []
                connection.expect_ok(_command(b"AUTH", *user, target.password.encode()))
            if target.db:
                connection.expect_ok(_command(b"SELECT", b"%d" % target.db))
        except BaseException:
            sock.close()
            raise
        return connection

    def expect_ok(self, command: bytes) -> None:
        self.sock.sendall(command)
        line = self._line()
        if line != b"+OK":
            raise RespProtocolError(f"Redis refused the connection setup: {line[:200]!r}")

    def read_bulk(self, buffer: memoryview) -> int:
        """Read one bulk reply into the start of `buffer`; its length."""
        line = self._line()
        if line.startswith(b"-"):  # an error for this key (WRONGTYPE...): a miss
            return 0
        if not line.startswith(b"$"):
            raise RespProtocolError(f"expected a bulk reply, got {line[:200]!r}")
        size = int(line[1:])
        if size < 0:
            return 0
        if size > buffer.nbytes:
            raise RespProtocolError(f"a {size}-byte reply to a GETRANGE of {buffer.nbytes}")
        self._read_exactly(buffer[:size])
        crlf = memoryview(bytearray(2))
        self._read_exactly(crlf)
        if crlf != b"\r\n":
            raise RespProtocolError("a bulk reply without its CRLF")
        return size

    def close(self) -> None:
        self.sock.close()

    def closed_by_peer(self) -> bool:
        """Between replies a connection has nothing to read; if it has, Redis closed it
        (end of file) or sent what no request asked for: either way it is unusable."""
        if self._pending:
            return True
        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    def _line(self) -> bytes:
        while b"\r\n" not in self._pending:
            if len(self._pending) > LINE_LIMIT:
                raise RespProtocolError("a reply line longer than a bulk header")
            chunk = self.sock.recv(LINE_LIMIT)
            if not chunk:
                raise ConnectionError("Redis closed the connection")
            self._pending += chunk
        line, _, rest = bytes(self._pending).partition(b"\r\n")
        self._pending = bytearray(rest)
        return line

    def _read_exactly(self, out: memoryview) -> None:
        have = min(len(self._pending), out.nbytes)
        out[:have] = self._pending[:have]
        del self._pending[:have]
        while have < out.nbytes:
            got = self.sock.recv_into(out[have:])
            if not got:
                raise ConnectionError("Redis closed the connection")
            have += got


def _connect(target: RedisTarget, timeout_s: float) -> socket.socket:
    """A socket connected to the target's server: its Unix socket, or TCP."""
    if target.socket_path is None:
        return socket.create_connection(target.nodes[0], timeout=timeout_s)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(target.socket_path)
    except BaseException:
        sock.close()
        raise
    return sock
