"""Admission counts sequences (prompts x n), not requests: a request needing more than the
queue holds is a 400 naming the limit, a busy queue answers 503 by sequences, and a
client's small request behind the biggest one that still leaves it a slot finishes
within one run of that request's sequences (counted in generated tokens, not seconds)."""

from __future__ import annotations

import json

import httpx
import pytest

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from engine.server.streams import EngineJob, RequestGroup
from tests.server.server_helpers import MODEL_NAME, ServerProcess, scrape, server_flags, value
from tests.server.test_async_engine import ScriptedEngine, run

pytestmark = pytest.mark.timeout(300)

MAX_NUM_SEQS = 2
QUEUE = 16  # --max-num-seqs 2 + --max-waiting-requests 14
BIG_TOKENS = 32
VICTIM_TOKENS = 4


def test_a_request_takes_a_queue_slot_per_sequence():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        jobs = [EngineJob(f"j-{i}", "p", SamplingParams(max_tokens=50, n=3)) for i in range(2)]
        group = RequestGroup(ae, jobs, None)
        await group.start()
        held = ae.num_pending_requests
        await group.aclose()
        return held, ae.num_pending_requests

    assert run(scenario, engine, max_pending_requests=8) == (6, 0)


@pytest.fixture(scope="module")
def small_queue_server(model_path):
    process = ServerProcess(*server_flags(
        model_path, "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(QUEUE - MAX_NUM_SEQS),
    ))
    yield process
    process.stop()


def test_more_sequences_than_the_queue_holds_is_a_400_naming_the_limit(small_queue_server):
    url = small_queue_server.url
    chat = httpx.post(url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "n": QUEUE + 1})
    prompts = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL_NAME, "prompt": ["a", "b"], "max_tokens": 1, "n": QUEUE // 2 + 1})
    for response in (chat, prompts):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["code"], error["param"]) == ("too_many_sequences", "n")
        assert f"at most {QUEUE} at once" in error["message"]


def test_a_small_request_is_not_stuck_behind_the_biggest_one(small_queue_server):
    url = small_queue_server.url
    big = {"model": MODEL_NAME, "prompt": "the big one", "n": QUEUE - 1, "max_tokens": BIG_TOKENS,
           "ignore_eos": True, "stream": True}
    victim = {"model": MODEL_NAME, "prompt": "a small one", "max_tokens": VICTIM_TOKENS, "ignore_eos": True}
    with httpx.Client(base_url=url, timeout=120) as http, http.stream("POST", "/v1/completions", json=big) as held:
        events = held.iter_lines()
        assert next(events).startswith("data: ")  # admitted: its sequences hold QUEUE - 1 slots
        two_more = http.post("/v1/completions", json={**victim, "n": 2})
        assert two_more.status_code == 503, two_more.text
        assert two_more.json()["error"]["code"] == "queue_full"
        before = value(scrape(http), "vllm:generation_tokens")
        answer = http.post("/v1/completions", json=victim)
        generated = value(scrape(http), "vllm:generation_tokens") - before
        assert answer.status_code == 200, answer.text
        rest = [json.loads(e.removeprefix("data: ")) for e in events if e.startswith("data: {")]
    assert sum(len(c["choices"]) for c in rest) > 0
    # Fair admission: the victim takes the first slot a big sequence frees, so about one
    # run of the running big sequences and its own are generated meanwhile (2 * 32 + 8),
    # plus the steps between its answer and the scrape. First come first served ran at
    # least 12 of the 15 big sequences first (384 tokens): half of the big request's
    # tokens tells them apart on a host of any speed.
    print(f"tokens generated while the victim waited and ran: {generated:.0f}")
    assert generated < (QUEUE - 1) * BIG_TOKENS / 2, generated
