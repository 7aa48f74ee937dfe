"""`kvtier router`'s relaying (engine/router/app.py) in front of stand-in instances on
loopback (tests/router/fake_instance.py), the router served by uvicorn as `kvtier router`
serves it: a stream reaches the client piece by piece as the instance sends it, one cut
short stays cut short, a request that fails before the instance's first byte goes once
to another instance, a client that leaves closes the instance's connection, connections
to an instance are kept alive, and the router's own errors are OpenAI error bodies."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import uvicorn

from engine.config import RouterConfig
from engine.router.app import build_router_app
from tests.router.fake_instance import (
    FakeInstance,
    Request,
    answer_json,
    chunk,
    completion,
    gated_stream,
    save_tokenizer,
    start_chunked,
)

WAIT_S = 10.0  # a deadline for what happens by itself, never a measured time
BODY = {"model": "m", "prompt": "w1 w2 w3 w4 w5 w6 w7 w8 w9", "max_tokens": 2}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def run(test) -> None:
    asyncio.run(asyncio.wait_for(test(), WAIT_S * 3))


@asynccontextmanager
async def router(*instances: FakeInstance, policy: str = "round-robin") -> AsyncIterator[httpx.AsyncClient]:
    """The router over `instances`, and a client of it."""
    config = RouterConfig(worker_urls=[i.url for i in instances], policy=policy, port=0,
                          health_check_interval=3600)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_router_app(config), log_level="warning"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(WAIT_S):
            while not server.started:
                await asyncio.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with httpx.AsyncClient(base_url=url, timeout=WAIT_S) as client:
            yield client
    finally:
        server.should_exit = True
        await task
        for instance in instances:
            await instance.stop()


async def metric(client: httpx.AsyncClient, name: str) -> float:
    text = (await client.get("/metrics")).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def test_answers_pass_through_and_connections_are_kept_alive(tokenizer_dir):
    async def test() -> None:
        instance = await FakeInstance(tokenizer_dir).start()
        async with router(instance, policy="kv") as client:
            for _ in range(3):
                whole = await client.post("/v1/completions", json=BODY)
                assert whole.status_code == 200 and whole.json()["choices"][0]["text"] == "a"
                streamed = await client.post("/v1/completions", json={**BODY, "stream": True})
                assert streamed.status_code == 200
                assert streamed.headers["content-type"] == "text/event-stream"
                assert streamed.text == 'data: {"choices":[{"index":0,"text":"a"}]}\n\ndata: [DONE]\n\n'
            # the checks at start and six requests, one after another, on one connection
            assert instance.connections == 1 and len(instance.requests) == 6
            assert instance.requests[0].body == b'{"model":"m","prompt":"w1 w2 w3 w4 w5 w6 w7 w8 w9","max_tokens":2}'
            assert instance.requests[0].headers["content-type"] == "application/json"
            assert await metric(client, "kvtier:router_reported_cached_tokens_total") == 3 * 2
            assert await metric(client, "kvtier:router_predicted_cached_tokens_total") == 0
            assert await metric(client, "kvtier:router_routing_seconds_count") == 6  # each request timed once

    run(test)


def test_a_stream_reaches_the_client_piece_by_piece_as_the_instance_sends_it(tokenizer_dir):
    """The instance sends its second event only once the client has the first: a router
    that held the stream back would never let this end."""
    first_seen = asyncio.Event()

    async def test() -> None:
        instance = await FakeInstance(tokenizer_dir, gated_stream(first_seen, WAIT_S)).start()
        async with router(instance) as client, \
                client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as stream:
            received = b""
            async for piece in stream.aiter_bytes():
                received += piece
                if b"data: one\n\n" in received:
                    first_seen.set()
            assert received == b"data: one\n\ndata: two\n\n"

    run(test)


def test_a_stream_the_instance_breaks_off_is_cut_short_for_the_client(tokenizer_dir):
    """The client must not take a cut stream for a whole one: its connection closes
    without the chunked body's end. The instance stays in the pool (it answered)."""
    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        if request.json().get("stream"):
            await start_chunked(writer)
            await chunk(writer, b"data: one\n\n")
            writer.close()
        else:
            await completion(request, writer)

    async def test() -> None:
        instance = await FakeInstance(tokenizer_dir, handler).start()
        async with router(instance) as client:
            with pytest.raises(httpx.RemoteProtocolError):
                async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as stream:
                    async for _ in stream.aiter_bytes():
                        pass
            assert (await client.post("/v1/completions", json=BODY)).status_code == 200
            assert (await client.get("/health")).json()["instances"] == {instance.url: "healthy"}
            assert await metric(client, "kvtier:router_retries_total") == 0

    run(test)


def test_a_request_that_fails_before_the_first_byte_goes_once_to_another_instance(tokenizer_dir):
    async def hang_up(request: Request, writer: asyncio.StreamWriter) -> None:
        writer.close()

    async def overloaded(request: Request, writer: asyncio.StreamWriter) -> None:
        await answer_json(writer, {"error": {"message": "busy"}}, status=503)

    async def test() -> None:
        broken = await FakeInstance(tokenizer_dir, hang_up).start()
        busy = await FakeInstance(tokenizer_dir, overloaded).start()
        good = await FakeInstance(tokenizer_dir).start()
        async with router(broken, good) as client:
            for stream in (False, True, False, True):
                response = await client.post("/v1/completions", json={**BODY, "stream": stream})
                assert response.status_code == 200 and response.text.count('"a"') == 1
            # the broken one had it twice (on the checks' kept-alive connection, then once more
            # on a new one, as for a connection it had closed while idle), then left the pool
            assert len(broken.requests) == 2 and len(good.requests) == 4
            assert await metric(client, "kvtier:router_retries_total") == 1
            assert (await client.get("/health")).json()["instances"] == {broken.url: "unhealthy",
                                                                         good.url: "healthy"}
        busy2 = await FakeInstance(tokenizer_dir, overloaded).start()
        good = await FakeInstance(tokenizer_dir).start()
        async with router(busy, good) as client:
            for _ in range(4):
                assert (await client.post("/v1/completions", json=BODY)).status_code == 200
            assert len(busy.requests) == 2 and len(good.requests) == 4  # a 5xx answer: it stays
            assert await metric(client, "kvtier:router_retries_total") == 2
        async with router(busy2) as client:  # the last instance's 5xx is the answer
            response = await client.post("/v1/completions", json=BODY)
            assert response.status_code == 503 and response.json() == {"error": {"message": "busy"}}

    run(test)


def test_a_client_that_leaves_mid_stream_closes_the_instances_connection(tokenizer_dir):
    gone = asyncio.Event()

    async def handler(request: Request, writer: asyncio.StreamWriter) -> None:
        await start_chunked(writer)
        await chunk(writer, b"data: one\n\n")
        await request.client_gone()
        gone.set()

    async def test() -> None:
        instance = await FakeInstance(tokenizer_dir, handler).start()
        async with router(instance) as client:
            async with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as stream:
                async for _ in stream.aiter_bytes():
                    break
            await asyncio.wait_for(gone.wait(), WAIT_S)
            async with asyncio.timeout(WAIT_S):  # no longer counted on the instance
                while await metric(client, "kvtier:router_instance_load") != 0:
                    await asyncio.sleep(0.01)

    run(test)


def test_the_routers_own_errors_are_openai_error_bodies(tokenizer_dir):
    async def refuse(request: Request, writer: asyncio.StreamWriter) -> None:
        await answer_json(writer, {"error": {"message": "not JSON", "type": "invalid_request_error"}}, status=400)

    async def test() -> None:
        instance = await FakeInstance(tokenizer_dir, refuse).start()
        async with router(instance) as client:
            wrong = await client.get("/v1/completions")
            assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
            assert wrong.json()["error"]["type"] == "invalid_request_error"
            # a body the router cannot read is the instance's to refuse, as it came
            bad = await client.post("/v1/chat/completions", content=b"{not json",
                                    headers={"content-type": "application/json"})
            assert bad.status_code == 400 and bad.json()["error"]["message"] == "not JSON"
            assert instance.requests[-1].body == b"{not json"
            await instance.stop()
            for _ in range(2):  # the first finds it gone, the second finds no instance
                none = await client.post("/v1/completions", json=BODY)
                assert none.status_code == 503
                assert none.json()["error"] == {"message": "no kvtier instance is available (see the router's "
                                                "/health)", "type": "server_error", "param": None,
                                                "code": "no_instance"}

    run(test)
