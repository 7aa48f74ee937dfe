"""Pinning through the admin API keeps a prefix in the cpu tier across traffic that evicts
everything else: a small device pool and a 16-chunk cpu tier, then 20 other prompts."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.server.server_helpers import ADMIN_TOKEN, MODEL_NAME, ServerProcess, server_flags

pytestmark = pytest.mark.timeout(120)

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHUNK_TOKENS = 32
PROMPT_TOKENS = 6 * CHUNK_TOKENS


@pytest.fixture(scope="module")
def small_cache_server(model_path):
    process = ServerProcess(*server_flags(
        model_path, "--enable-kv-admin", "--admin-token", ADMIN_TOKEN, "--kv-offload", "cpu",
        "--kv-offload-cpu-size", "256KiB", "--kv-chunk-tokens", str(CHUNK_TOKENS),
        num_kv_blocks=32,
    ))
    yield process
    process.stop()


def cpu_tier(client: httpx.Client) -> dict:
    return client.get("/kv/stats", headers=AUTH).json()["tiers"]["cpu"]


def wait_for_saves(client: httpx.Client, puts: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while cpu_tier(client)["puts"] < puts:
        assert time.monotonic() < deadline, "the store never saved the prompts' chunks"
        time.sleep(0.05)


def test_pinned_prefix_survives_traffic_that_evicts_the_rest(small_cache_server):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 480) for _ in range(PROMPT_TOKENS)] for _ in range(22)]
    pinned, unpinned, traffic = prompts[0], prompts[1], prompts[2:]
    chunks_per_prompt = PROMPT_TOKENS // CHUNK_TOKENS
    with httpx.Client(base_url=small_cache_server.url, timeout=60) as client:

        def cached_tokens(prompt: list[int]) -> int:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1}
            return client.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        pin = client.post("/kv/pin", headers=AUTH, json={"prompt": pinned, "ttl": 600}).json()
        assert pin["pinned_chunks"] == chunks_per_prompt
        assert cached_tokens(pinned) == cached_tokens(unpinned) == 0
        wait_for_saves(client, 2 * chunks_per_prompt)
        for prompt in traffic:
            cached_tokens(prompt)
        wait_for_saves(client, len(prompts) * chunks_per_prompt)
        tier = cpu_tier(client)
        assert tier["evictions"] >= len(traffic) * chunks_per_prompt - tier["entries"]

        assert cached_tokens(pinned) >= PROMPT_TOKENS - CHUNK_TOKENS
        assert cached_tokens(unpinned) == 0
