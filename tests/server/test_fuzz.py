"""Fuzz the request schema against the real server: whatever the body, the answer is a
success or a well-formed 4xx, never a 5xx, and the server keeps serving."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.server_helpers import MODEL_NAME

pytestmark = pytest.mark.timeout(120)

FUZZ = settings(
    max_examples=150, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)


def plausible(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly values of the right shape, sometimes anything JSON can hold."""
    return st.one_of(valid, valid, json_values)


token_ids = st.lists(st.integers(0, 600), min_size=1, max_size=12)
sampling_fields = {
    "model": plausible(st.sampled_from([MODEL_NAME, "other"])),
    "temperature": plausible(st.floats(0, 2)),
    "top_p": plausible(st.floats(0, 1)),
    "top_k": plausible(st.integers(-2, 40)),
    "min_p": plausible(st.floats(0, 1)),
    "seed": plausible(st.integers(-5, 2**64)),
    "stop": plausible(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=3)),
    "stop_token_ids": plausible(st.lists(st.integers(-1, 600), max_size=3)),
    "n": plausible(st.integers(0, 2)),
    "ignore_eos": plausible(st.booleans()),
    "stream": plausible(st.booleans()),
    "stream_options": plausible(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "cache_salt": plausible(st.text(max_size=8)),
    "frequency_penalty": plausible(st.just(0.0)),
    "user": json_values,
    "unknown_field": json_values,
}
completion_bodies = st.fixed_dictionaries(
    {
        "prompt": plausible(st.text(max_size=40) | token_ids | st.lists(token_ids, min_size=1, max_size=3)),
        "max_tokens": plausible(st.integers(1, 4)),
    },
    optional={**sampling_fields, "logprobs": plausible(st.integers(0, 2)),
              "echo": plausible(st.booleans()), "best_of": plausible(st.integers(0, 2))},
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": plausible(st.sampled_from(["system", "user", "assistant", "robot"])),
         "content": plausible(st.text(max_size=30) | st.just([{"type": "text", "text": "hi"}]))},
        optional={"name": json_values},
    ),
    max_size=4,
)
chat_bodies = st.fixed_dictionaries(
    {"messages": plausible(messages), "max_tokens": plausible(st.integers(1, 4))},
    optional={**sampling_fields, "logprobs": plausible(st.booleans()),
              "top_logprobs": plausible(st.integers(0, 2)), "max_completion_tokens": plausible(st.integers(1, 4))},
)


def assert_served(response) -> None:
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["usage"]["completion_tokens"] >= 1


def post(http, path: str, content: bytes):
    return http.post(path, content=content, headers={"content-type": "application/json"})


@FUZZ
@given(body=completion_bodies)
def test_completions_schema_never_5xx(http, body):
    assert_served(post(http, "/v1/completions", json.dumps(body).encode()))


@FUZZ
@given(body=chat_bodies)
def test_chat_schema_never_5xx(http, body):
    assert_served(post(http, "/v1/chat/completions", json.dumps(body).encode()))


@settings(FUZZ, max_examples=60)
@given(raw=st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_arbitrary_bodies_never_5xx(http, raw, path):
    assert_served(post(http, path, raw))


def test_server_still_healthy_after_fuzzing(http):
    assert http.get("/health").status_code == 200
