"""The listening socket of `kvtier serve` and `kvtier router`."""

from __future__ import annotations

import socket

from engine.config import ConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind now, so a busy port fails before the model loads (uvicorn listens on it later).

    The protocol is named: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on
    connections whose socket says IPPROTO_TCP, and accepted connections inherit the
    listener's 0. With Nagle on, a response's body waits behind its headers for the
    client's delayed ACK, about 40 ms on Linux, on every request."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError("port", f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
