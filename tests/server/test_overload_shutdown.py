"""A server with room for one request: the bounded queue answers 503 + Retry-After, the
admin API is off by default, and SIGTERM lets in-flight streams finish. A server with
room for three: a completion's prompts are admitted together or not at all, and more
prompts than the queue holds are a 400, never a 503."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.server_helpers import MODEL_NAME, ServerProcess, server_flags

pytestmark = pytest.mark.timeout(120)

LONG_STREAM = {"model": MODEL_NAME, "prompt": "hold the only slot", "max_tokens": 200,
               "ignore_eos": True, "stream": True}
SHORT = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def one_slot_server(model_path):
    process = ServerProcess(*server_flags(
        model_path, "--max-num-seqs", "1", "--max-waiting-requests", "0", "--retry-after", "7",
    ))
    yield process
    process.stop()


def test_full_queue_answers_503_with_retry_after(one_slot_server):
    url = one_slot_server.url
    with httpx.stream("POST", url + "/v1/completions", json=LONG_STREAM, timeout=30) as held:
        events = held.iter_lines()  # kept referenced: dropping it would close the stream
        assert next(events).startswith("data: ")
        refused = httpx.post(url + "/v1/completions", json=SHORT, timeout=30)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "7"
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("server_error", "queue_full")
    metrics = httpx.get(url + "/metrics").text
    assert f'kvtier:requests_rejected_total{{model_name="{MODEL_NAME}",reason="queue_full"}} 1.0' in metrics
    deadline = time.monotonic() + 10
    while (status := httpx.post(url + "/v1/completions", json=SHORT, timeout=30).status_code) == 503:
        assert time.monotonic() < deadline, "the slot of the closed stream was never released"
        time.sleep(0.05)
    assert status == 200


def test_more_prompts_than_the_queue_holds_is_a_400(one_slot_server):
    response = httpx.post(one_slot_server.url + "/v1/completions", json={**SHORT, "prompt": ["a", "b"]}, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "too_many_prompts"


@pytest.fixture(scope="module")
def three_slot_server(model_path):
    # Room for a stream that outlasts the test's requests: 200 tokens of the tiny model
    # can be done before a slow machine has sent the next two requests.
    process = ServerProcess(*server_flags(
        model_path, "--max-num-seqs", "2", "--max-waiting-requests", "1", "--max-model-len", "4096",
    ))
    yield process
    process.stop()


def engine_requests_seen(url: str) -> float:
    """Requests the engine finished or aborted, whatever the reason."""
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    family = next(f for f in families if f.name == "vllm:request_success")
    return sum(s.value for s in family.samples if s.name.endswith("_total"))


def test_a_completion_is_admitted_whole_or_not_at_all(three_slot_server):
    url = three_slot_server.url
    longer = {**LONG_STREAM, "max_tokens": 3000}  # the client's close aborts it
    with httpx.stream("POST", url + "/v1/completions", json=longer, timeout=30) as held:
        events = held.iter_lines()
        assert next(events).startswith("data: ")
        seen = engine_requests_seen(url)
        refused = httpx.post(url + "/v1/completions", json={**SHORT, "prompt": ["a", "b", "c"]}, timeout=30)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "queue_full"
        assert engine_requests_seen(url) == seen  # none of its prompts ran (nor was aborted)
        fits = httpx.post(url + "/v1/completions", json={**SHORT, "prompt": ["a", "b"]}, timeout=30)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
    never = httpx.post(url + "/v1/completions", json={**SHORT, "prompt": ["a"] * 4}, timeout=30)
    assert never.status_code == 400 and never.json()["error"]["code"] == "too_many_prompts"


def test_admin_api_is_off_unless_enabled(one_slot_server):
    response = httpx.get(one_slot_server.url + "/kv/stats", headers={"Authorization": "Bearer x"})
    assert response.status_code == 404


def test_sigterm_finishes_in_flight_stream_then_exits_cleanly(model_path):
    server = ServerProcess(*server_flags(model_path))
    body = {**LONG_STREAM, "logprobs": 1}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        first = next(lines)
        server.process.terminate()
        events = [first, *(line for line in lines if line)]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks) == 200
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(30) == 0, server.output
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health")
