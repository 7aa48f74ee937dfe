"""Issue 44's admission and admin scenarios on the shared fault server (16 running, 512
waiting): `n` counted at admission with fair admission between calls, and admin pins
that do bounded work and say what they hold."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from reliability_support import ADMIN_TOKEN, CHUNK, FaultServer
from scorecard import Scorecard

QUEUE = 16 + 512  # --max-num-seqs + --max-waiting-requests of the fault server
BIG_PROMPTS, BIG_N, BIG_TOKENS = 4, 128, 8
PROMPT = [5, 6, 7, 8]  # far from the poison position


def generation_tokens(url: str) -> float:
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    family = next(f for f in families if f.name == "vllm:generation_tokens")
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def test_n_cannot_get_past_admission(fault_server: FaultServer, scorecard: Scorecard):
    """Before: 8 prompts x n=128 x 64 tokens took one slot per prompt, and another
    client's 4-token request waited 478 s behind its 1,024 sequences."""
    base = {"model": "tiny", "prompt": [PROMPT] * BIG_PROMPTS, "max_tokens": BIG_TOKENS, "ignore_eos": True}
    victim = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "ignore_eos": True}
    with httpx.Client(base_url=fault_server.url, timeout=300) as http:
        refused = http.post("/v1/completions", json={**base, "prompt": [PROMPT] * 8, "n": BIG_N})
        with http.stream("POST", "/v1/completions", json={**base, "n": BIG_N, "stream": True}) as big:
            events = big.iter_lines()
            assert next(events).startswith("data: ")  # its 512 sequences hold 512 of the 528 slots
            busy = http.post("/v1/completions", json={**victim, "n": QUEUE - BIG_PROMPTS * BIG_N + 1})
            before, started = generation_tokens(fault_server.url), time.monotonic()
            answer = http.post("/v1/completions", json=victim)
            seconds = time.monotonic() - started
            generated = generation_tokens(fault_server.url) - before
            for _ in events:  # the big request runs to its end
                pass
    big_tokens = BIG_PROMPTS * BIG_N * BIG_TOKENS
    scorecard.add(
        "security", "n past admission: 4 prompts x n=128 ahead of a 4-token request", requests=4, faults=2,
        wrong_outputs=0, status_of_8_prompts_x_n_128=refused.status_code, status_when_busy=busy.status_code,
        victim_status=answer.status_code, victim_seconds=seconds, tokens_generated_while_the_victim_ran=generated,
        tokens_of_the_big_request=big_tokens,
    )
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "too_many_sequences"
    assert busy.status_code == 503 and busy.json()["error"]["code"] == "queue_full"
    assert answer.status_code == 200
    # first come first served ran about 496 of the 512 sequences first
    assert generated < big_tokens / 2


def test_admin_pins_do_bounded_work_and_say_why(fault_server: FaultServer, scorecard: Scorecard):
    """Before: a pin of any length was tokenized on the engine thread (8 MB: streams stalled
    52 s), messages: [] was a 500, and a pin that held nothing answered pinned_chunks: 0."""
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    cases = {
        "200 KB text": {"prompt": "ordinary words " * 13_000},
        "empty messages": {"messages": []},
        "shorter than a chunk": {"prompt": [9] * (CHUNK - 1)},
        "never computed": {"prompt": [11 + i % 400 for i in range(2 * CHUNK)]},
    }
    answers, seconds = {}, {}
    with httpx.Client(base_url=fault_server.url, timeout=120) as http:
        for name, body in cases.items():
            started = time.monotonic()
            answers[name] = http.post("/kv/pin", headers=auth, json=body)
            seconds[name] = time.monotonic() - started
    scorecard.add(
        "security", "admin pins: oversized, empty, short, never computed", requests=len(cases), faults=2,
        wrong_outputs=0, **{f"status ({name})": a.status_code for name, a in answers.items()},
        **{f"seconds ({name})": s for name, s in seconds.items()},
    )
    assert answers["200 KB text"].status_code == 400
    assert answers["200 KB text"].json()["error"]["code"] == "context_length_exceeded"
    assert answers["empty messages"].status_code == 400
    short, never = answers["shorter than a chunk"].json(), answers["never computed"].json()
    assert short["pinned_chunks"] == 0 and "fewer than one chunk" in short["reason"]
    assert (never["pinned_chunks"], never["stored_chunks"]) == (2, 0) and "not stored yet" in never["reason"]
