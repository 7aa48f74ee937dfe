"""Async HTTP clients of the OpenAI completions API, as the reliability tests use it:
greedy completions of token-id prompts, streamed or not, and the admin view of the
engine (`/kv/stats`)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

MODEL = "tiny"


@dataclass
class Completion:
    """One answer: HTTP status, the text (streamed deltas joined), the finish reason,
    and the error body if there was one (a non-2xx body or an error event)."""

    status: int
    text: str = ""
    finish_reason: str | None = None
    error: dict | None = None
    events: int = 0
    done: bool = False  # the stream ended with [DONE]
    first_token_s: float | None = None


def body(prompt: list[int], max_tokens: int, stream: bool, **extra: object) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": stream, **extra}


async def complete(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, **extra: object) -> Completion:
    response = await client.post("/v1/completions", json=body(prompt, max_tokens, False, **extra))
    data = response.json()
    if response.status_code != 200:
        return Completion(response.status_code, error=data.get("error"))
    choice = data["choices"][0]
    return Completion(200, choice["text"], choice["finish_reason"])


async def stream(
    client: httpx.AsyncClient, prompt: list[int], max_tokens: int, stop_after: int | None = None,
    first_token: asyncio.Event | None = None, **extra: object,
) -> Completion:
    """Stream a completion; with `stop_after`, hang up after that many events; sets
    `first_token` once text arrives."""
    started = time.monotonic()
    request = body(prompt, max_tokens, True, **extra)
    async with client.stream("POST", "/v1/completions", json=request) as response:
        if response.status_code != 200:
            return Completion(response.status_code, error=json.loads(await response.aread()).get("error"))
        result = Completion(200)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            _take_event(result, line.removeprefix("data: "), started)
            if first_token is not None and result.text:
                first_token.set()
            if result.done or (stop_after is not None and result.events >= stop_after):
                break
    return result


def _take_event(result: Completion, data: str, started: float) -> None:
    if data == "[DONE]":
        result.done = True
        return
    result.events += 1
    event = json.loads(data)
    if "error" in event:
        result.error = event["error"]
        return
    choice = event["choices"][0]
    if choice["text"] and result.first_token_s is None:
        result.first_token_s = time.monotonic() - started
    result.text += choice["text"]
    result.finish_reason = choice["finish_reason"] or result.finish_reason


def kv_stats(url: str, token: str) -> dict:
    response = httpx.get(url + "/kv/stats", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def server_held_blocks(stats: dict) -> int:
    """Device blocks held by requests, from `/kv/stats`."""
    device = stats["device"]
    return round(device["kv_cache_usage_perc"] * device["num_kv_blocks"])


def busy(stats: dict) -> float:
    """Requests running or waiting, in-flight API requests and held device blocks."""
    device = stats["device"]
    return (device["num_requests_running"] + device["num_requests_waiting"]
            + device["kv_cache_usage_perc"] + stats["pending_requests"])


def wait_idle(url: str, token: str, timeout_s: float = 30.0) -> float:
    """Seconds until the server holds no request and no device block."""
    started = time.monotonic()
    while busy(kv_stats(url, token)):
        assert time.monotonic() - started < timeout_s, f"still busy: {kv_stats(url, token)}"
        time.sleep(0.05)
    return time.monotonic() - started
