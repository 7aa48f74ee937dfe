"""`/kv/pin` passes the body's cache_salt down to the block hashes (issue 44, item 18): a
salted pin names the chunks that the same tenant's requests save, and neither the
unsalted nor another tenant's pin of the same tokens names them. The shared `server`
fixture (cpu tier, 32-token chunks); `stored_chunks` says how many named chunks exist."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from tests.server.server_helpers import ADMIN_TOKEN, MODEL_NAME

pytestmark = pytest.mark.timeout(300)

AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CHUNKS = 3
PROMPT = [random.Random(181).randrange(3, 480) for _ in range(CHUNKS * 32 + 5)]
SALT = "tenant-x"
SAVE_DEADLINE_S = 60  # a failure guard: the saves of one request take milliseconds


def pin(http: httpx.Client, cache_salt: str | None) -> dict:
    body = {"prompt": PROMPT, "ttl": 600, **({"cache_salt": cache_salt} if cache_salt else {})}
    response = http.post("/kv/pin", headers=AUTH, json=body)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_salted_pin_names_its_tenants_chunks_only(http):
    done = http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 1,
                                              "cache_salt": SALT})
    assert done.status_code == 200, done.text
    deadline = time.monotonic() + SAVE_DEADLINE_S
    while (mine := pin(http, SALT))["stored_chunks"] < CHUNKS:
        assert time.monotonic() < deadline, f"the salted pin never named the tenant's saved chunks: {mine}"
        time.sleep(0.1)
    assert (mine["pinned_chunks"], mine["stored_chunks"]) == (CHUNKS, CHUNKS)
    for other in (None, "tenant-y"):  # the same tokens, other chunks: none of them computed
        answer = pin(http, other)
        assert (answer["pinned_chunks"], answer["stored_chunks"]) == (CHUNKS, 0)
    for salt in (SALT, None, "tenant-y"):
        body = {"prompt": PROMPT, **({"cache_salt": salt} if salt else {})}
        assert http.post("/kv/unpin", headers=AUTH, json=body).json() == {"unpinned_chunks": CHUNKS}
