"""The listening socket `kvtier serve` and `kvtier router` hand to uvicorn: connections
accepted on it must run without Nagle's algorithm, or every response's body waits behind
its headers for the client's delayed ACK."""

from __future__ import annotations

import asyncio
import socket

import pytest

from engine.config import ConfigError
from engine.server.api_server import bind_socket


class _Recorder(asyncio.Protocol):
    def __init__(self, seen: asyncio.Future[int]) -> None:
        self.seen = seen

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        sock = transport.get_extra_info("socket")
        self.seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        transport.close()


async def _accepted_nodelay(host: str) -> int:
    """TCP_NODELAY of a connection that asyncio accepts on bind_socket's socket, as uvicorn does."""
    loop = asyncio.get_running_loop()
    seen: asyncio.Future[int] = loop.create_future()
    listener = bind_socket(host, 0)
    server = await loop.create_server(lambda: _Recorder(seen), sock=listener)
    port = listener.getsockname()[1]
    try:
        _, writer = await asyncio.open_connection(host, port)
        nodelay = await asyncio.wait_for(seen, 10)
        writer.close()
        return nodelay
    finally:
        server.close()
        await server.wait_closed()


def test_accepted_connections_send_without_nagle():
    assert asyncio.run(_accepted_nodelay("127.0.0.1")) != 0


def test_accepted_ipv6_connections_send_without_nagle():
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    try:
        socket.getaddrinfo("::1", 0)
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback on this host")
    assert asyncio.run(_accepted_nodelay("::1")) != 0


def test_a_busy_port_is_a_config_error_naming_the_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigError) as raised:
            bind_socket("127.0.0.1", taken.getsockname()[1])
    assert raised.value.option == "port"
