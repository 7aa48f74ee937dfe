"""The router's HTTP/1.1 client to an instance (engine/router/upstream.py), against a real
loopback server: every framing of a body read whole and piece by piece as it arrives,
keep-alive connections reused, an instance that fails before its answer or during it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from engine.router.upstream import Upstream, UpstreamError
from tests.router.fake_instance import (
    FakeInstance,
    Handler,
    Request,
    answer,
    answer_json,
    chunk,
    end_chunked,
    gated_stream,
    start_chunked,
)

WAIT_S = 10.0  # a deadline for what happens by itself, never a measured time


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), WAIT_S * 3))


@asynccontextmanager
async def serving(handler: Handler) -> AsyncIterator[tuple[FakeInstance, Upstream]]:
    """A stand-in instance answering with `handler`, and a client of it."""
    instance = await FakeInstance("", handler).start()
    upstream = Upstream(instance.url)
    try:
        yield instance, upstream
    finally:
        upstream.close()
        await instance.stop()


def test_bodies_of_every_framing_are_read_whole():
    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        if request.path == "/length":
            await answer(writer, b"x" * 100_000, content_type=b"text/plain")
        elif request.path == "/chunked":
            await start_chunked(writer)
            for piece in (b"ab", b"c" * 70_000, b"d"):
                await chunk(writer, piece)
            await end_chunked(writer)
        elif request.path == "/empty":
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        else:  # no length, no chunks: the body ends with the connection
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")
            writer.close()

    async def test() -> None:
        async with serving(handler) as (instance, upstream):
            assert await upstream.get("/length") == (200, b"x" * 100_000)
            assert await upstream.get("/chunked") == (200, b"ab" + b"c" * 70_000 + b"d")
            assert await upstream.get("/empty") == (204, b"")
            assert await upstream.get("/close") == (200, b"until the end")
            assert await upstream.get("/length") == (200, b"x" * 100_000)
            # one connection for the first four, a new one after the instance closed it
            assert instance.connections == 2

    run(test)


def test_a_request_carries_its_body_and_headers_as_given():
    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        await answer_json(writer, {"got": request.json(), "auth": request.headers.get("authorization"),
                                   "host": request.headers.get("host")})

    async def test() -> None:
        async with serving(handler) as (instance, upstream):
            answer_ = await upstream.request("POST", "/v1/completions", [(b"authorization", b"Bearer k")],
                                             b'{"prompt": [1, 2]}')
            assert answer_.status == 200 and answer_.headers[b"content-type"] == b"application/json"
            assert (await answer_.read()) == (b'{"got": {"prompt": [1, 2]}, "auth": "Bearer k", "host": "'
                                              + instance.url.removeprefix("http://").encode() + b'"}')
            answer_.close()

    run(test)


def test_chunks_are_handed_on_as_they_arrive():
    """The second chunk is sent only once the first has come out of `chunks()`: a client
    that waited for more than what arrived would never see it."""
    first_seen = asyncio.Event()

    async def test() -> None:
        async with serving(gated_stream(first_seen, WAIT_S)) as (instance, upstream):
            answer_ = await upstream.request("POST", "/v1/completions", body=b"{}")
            pieces = []
            async for piece in answer_.chunks():
                pieces.append(piece)
                first_seen.set()
            answer_.close()
            assert pieces == [b"data: one\n\n", b"data: two\n\n"]
            # the gate open, a second answer comes whole, on the same connection
            assert await upstream.get("/again") == (200, b"data: one\n\ndata: two\n\n")
            assert instance.connections == 1

    run(test)


def test_an_instance_that_breaks_off_its_answer_raises_and_its_connection_is_dropped():
    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        if request.path == "/chunked":
            await start_chunked(writer)
            await chunk(writer, b"data: one\n\n")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this")
        writer.close()

    async def test() -> None:
        async with serving(handler) as (_, upstream):
            for path in ("/chunked", "/length"):
                answer_ = await upstream.request("GET", path)
                pieces = []
                with pytest.raises(UpstreamError, match="the connection closed"):
                    async for piece in answer_.chunks():
                        pieces.append(piece)
                assert pieces == [b"data: one\n\n" if path == "/chunked" else b"only this"]
                answer_.close()

    run(test)


def test_an_answer_closed_before_its_end_closes_the_connection():
    """The instance learns its client left (and stops the request), and the connection,
    with the rest of an answer in it, is not used again."""
    gone = asyncio.Event()

    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        if request.path == "/short":
            await answer_json(writer, {})
            return
        await start_chunked(writer)
        await chunk(writer, b"data: one\n\n")
        await request.client_gone()
        gone.set()

    async def test() -> None:
        async with serving(handler) as (instance, upstream):
            answer_ = await upstream.request("POST", "/v1/completions", body=b"{}")
            async for _ in answer_.chunks():
                break
            answer_.close()
            await asyncio.wait_for(gone.wait(), WAIT_S)
            assert (await upstream.get("/short"))[0] == 200 and instance.connections == 2

    run(test)


def test_no_instance_or_no_answer_is_an_upstream_error():
    async def test() -> None:
        with socket.socket() as free:
            free.bind(("127.0.0.1", 0))
            port = free.getsockname()[1]
        with pytest.raises(UpstreamError, match="cannot connect"):
            await Upstream(f"http://127.0.0.1:{port}").request("POST", "/v1/completions", body=b"{}")

        async def hang_up(request: Request, writer: asyncio.StreamWriter) -> None:
            writer.close()

        async with serving(hang_up) as (_, upstream):
            with pytest.raises(UpstreamError, match="no answer"):
                await upstream.request("POST", "/v1/completions", body=b"{}")

    run(test)


def test_a_reused_connection_the_instance_closed_is_replaced_not_failed():
    """An instance may close an idle keep-alive connection just as the router sends on
    it; the request then goes once more on a new connection instead of failing."""
    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        await answer_json(writer, {"path": request.path})

    async def test() -> None:
        async with serving(handler) as (instance, upstream):
            assert (await upstream.get("/first"))[0] == 200
            # the instance drops the idle connection without a word; the router has not
            # noticed yet (no loop turn between), as when the close crosses the request
            instance.abort_connections()
            assert await upstream.get("/second") == (200, b'{"path": "/second"}')
            assert instance.connections == 2
            assert [r.path for r in instance.requests] == ["/first", "/second"]

    run(test)

