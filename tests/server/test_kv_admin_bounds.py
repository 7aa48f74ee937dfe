"""The KV admin API does only bounded work on the engine thread and says what it did: a
pin is tokenized off the engine thread with the prompts' length limit, a flush waits on
Redis without stopping the streams, a pin that holds nothing says why and how its
prompt was tokenized (`messages` pin exactly what a chat request computes), and
messages a chat template cannot render are 400s naming the cause."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from bench.redis_server import RedisServer
from engine.server.errors import APIError
from engine.server.prompts import PromptTokenizer
from tests.server.server_helpers import (
    ADMIN_TOKEN,
    MAX_MODEL_LEN,
    MODEL_NAME,
    ServerProcess,
    server_flags,
)

pytestmark = pytest.mark.timeout(300)

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHUNK_TOKENS = 32  # the shared `server` fixture's --kv-chunk-tokens
# about 100 tokens once chat-templated: three whole chunks and a tail
MESSAGES = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "Which colour is the sky on a clear day, seen from the ground? " * 2}]


def pin(http: httpx.Client, body: dict) -> httpx.Response:
    return http.post("/kv/pin", headers=AUTH, json=body)


def test_a_pin_of_messages_is_what_the_chat_request_computes(http):
    first = pin(http, {"messages": MESSAGES, "ttl": 600})
    assert first.status_code == 200, first.text
    answer = first.json()
    assert answer["prompt_format"] == "chat"
    chat = http.post("/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 1})
    assert chat.status_code == 200, chat.text
    assert answer["prompt_tokens"] == chat.json()["usage"]["prompt_tokens"]
    chunks = answer["prompt_tokens"] // CHUNK_TOKENS
    assert chunks >= 2 and answer["pinned_chunks"] == chunks
    # the chat request saved the very chunks the pin named (same token ids, same hashes)
    deadline = time.monotonic() + 60
    while (again := pin(http, {"messages": MESSAGES, "ttl": 600}).json())["stored_chunks"] < chunks:
        assert time.monotonic() < deadline, f"the chat request's chunks never matched the pin: {again}"
        time.sleep(0.1)
    assert again["stored_chunks"] == again["pinned_chunks"] == chunks and "reason" not in again
    assert http.post("/kv/unpin", headers=AUTH, json={"messages": MESSAGES}).json() == {"unpinned_chunks": chunks}


def test_a_pin_that_holds_nothing_says_why(http):
    short = pin(http, {"prompt": [7] * (CHUNK_TOKENS - 1)}).json()
    assert (short["pinned_chunks"], short["prompt_tokens"], short["prompt_format"]) == (0, CHUNK_TOKENS - 1, "token_ids")
    assert "fewer than one chunk" in short["reason"] and f"({CHUNK_TOKENS} tokens)" in short["reason"]
    text = pin(http, {"prompt": "hello"}).json()
    assert text["prompt_format"] == "text" and text["pinned_chunks"] == 0 and "reason" in text

    never_computed = [11 + i % 200 for i in range(2 * CHUNK_TOKENS)]
    answer = pin(http, {"prompt": never_computed}).json()
    assert (answer["pinned_chunks"], answer["stored_chunks"]) == (2, 0)
    assert "2 of the 2 chunks are not stored yet" in answer["reason"]


def test_pin_refuses_what_no_request_could_send(http):
    empty = pin(http, {"messages": []})
    assert empty.status_code == 400, empty.text
    assert empty.json()["error"]["param"] == "messages"
    too_long = pin(http, {"prompt": [5] * MAX_MODEL_LEN})
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    long_text = pin(http, {"prompt": "many words of ordinary text " * 2000})  # 56 KB, under the body limit
    assert long_text.status_code == 400 and long_text.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("template, cause", [
    ("{% for i in range(10**8) %}x{% endfor %}", "OverflowError: Range too big"),
    ("{{ raise_exception('no system messages') }}", "no system messages"),
])
def test_a_chat_template_that_fails_is_a_400_naming_the_cause(model_path, template, cause):
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.chat_template = template
    prompts = PromptTokenizer(tokenizer, MAX_MODEL_LEN)
    with pytest.raises(APIError) as info:
        asyncio.run(prompts.encode_chat([{"role": "user", "content": "hi"}]))
    assert (info.value.status, info.value.param) == (400, "messages")
    assert cause in info.value.message


def test_a_flush_waiting_on_redis_does_not_stop_the_streams(model_path, redis_binary, tmp_path):
    """Redis pauses writes, so the flush's DEL waits (up to the tier's 120 s operation
    timeout); a completion sent meanwhile must finish while the flush still waits.
    Before, the flush held the engine thread and the completion came after it."""
    redis = RedisServer(redis_binary, tmp_path / "redis").start()
    process = ServerProcess(*server_flags(
        model_path, "--enable-kv-admin", "--admin-token", ADMIN_TOKEN, "--kv-offload", "cpu,redis",
        "--kv-redis-url", redis.url, "--kv-redis-op-timeout", "120", "--kv-offload-cpu-size", "16MiB",
        "--kv-chunk-tokens", str(CHUNK_TOKENS),
    ))
    client = redis.client()
    try:
        with httpx.Client(base_url=process.url, timeout=120) as http:
            body = {"model": MODEL_NAME, "prompt": [9] * (3 * CHUNK_TOKENS), "max_tokens": 1}
            assert http.post("/v1/completions", json=body).status_code == 200
            deadline = time.monotonic() + 60
            while client.dbsize() == 0:
                assert time.monotonic() < deadline, "the completion's chunks never reached Redis"
                time.sleep(0.1)
            scans = client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0)
            client.execute_command("CLIENT", "PAUSE", 100_000, "WRITE")
            flushed: list[httpx.Response] = []
            flush = threading.Thread(target=lambda: flushed.append(http.post("/kv/flush", headers=AUTH)))
            flush.start()
            while client.info("commandstats").get("cmdstat_scan", {}).get("calls", 0) == scans:
                assert flush.is_alive(), flushed
                time.sleep(0.05)
            # the flush has reached Redis and waits on its DEL
            reply = http.post("/v1/completions", json={**body, "prompt": "a stream during the flush"})
            flush_was_waiting = flush.is_alive()
            client.execute_command("CLIENT", "UNPAUSE")
            flush.join()
            assert reply.status_code == 200, reply.text
            assert flush_was_waiting, "the completion waited for the flush: it ran on the engine thread"
            assert flushed[0].status_code == 200, flushed[0].text
            assert flushed[0].json()["flushed_chunks"]["redis"] >= 3
    finally:
        client.execute_command("CLIENT", "UNPAUSE")
        process.stop()
        redis.kill()
