"""Structured outputs through the official `openai` client against a real `kvtier serve`:
response_format (json_object, json_schema), vLLM's structured_outputs and guided_* extras,
in chat and completions, streamed and not; and the 400s for what cannot be served."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.server.server_helpers import MODEL_NAME

pytestmark = pytest.mark.timeout(180)

MESSAGES = [{"role": "user", "content": "Describe one user of the cache as JSON."}]
USER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9999},
        "plan": {"enum": ["free", "pro", "team"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
        "ratio": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["id", "plan", "tags", "ratio"],
}


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def json_schema_format(schema: dict, strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "user", "schema": schema, "strict": strict}}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_json_schema_outputs_validate(client, stream):
    texts = []
    for seed in range(3):
        kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=120, temperature=1.0, seed=seed,
                      response_format=json_schema_format(USER))
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            texts.append("".join(c.choices[0].delta.content or "" for c in chunks if c.choices))
            assert chunks[-1].choices[0].finish_reason == "stop"
        else:
            reply = client.chat.completions.create(**kwargs)
            assert reply.choices[0].finish_reason == "stop"
            texts.append(reply.choices[0].message.content)
    for text in texts:
        value = json.loads(text)
        jsonschema.validate(value, USER)
        assert set(value) == set(USER["properties"])  # strict: no property beyond the schema's


def test_chat_json_object_and_completion_extras(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=60, temperature=0,
                                           response_format={"type": "json_object"})
    answer = reply.choices[0]
    # any object: its keys are unbounded, and a random model may write one until max_tokens
    assert answer.message.content.startswith("{")
    if answer.finish_reason == "stop":
        assert isinstance(json.loads(answer.message.content), dict)
    regex = client.completions.create(model=MODEL_NAME, prompt="Order number:", max_tokens=20, temperature=0,
                                      extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{4}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{4}", regex.choices[0].text)
    choice = client.completions.create(model=MODEL_NAME, prompt="Answer:", max_tokens=20, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.choices[0].text in {"yes", "no", "maybe"}
    closed = {**USER, "additionalProperties": False}  # no strict flag here: the schema closes itself
    schema = client.completions.create(model=MODEL_NAME, prompt=["One user:", "Another:"], max_tokens=120,
                                       temperature=0, extra_body={"guided_json": closed})
    for answer in schema.choices:
        jsonschema.validate(json.loads(answer.text), closed)


def test_an_unconstrained_request_is_not_json(client):
    """The control: the random model does not write JSON by itself."""
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(reply.choices[0].message.content)


@pytest.mark.parametrize(("body", "param", "needle"), [
    ({"response_format": json_schema_format({"type": "object", "properties": {"a": {"type": "strin"}}})},
     "response_format", "strin"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"guided_json": USER, "response_format": {"type": "json_object"}}, "guided_json", "at most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"guided_json": "[1, 2]"}, "guided_json", "JSON object"),
])
def test_constraints_that_cannot_be_served_are_400s_naming_the_field(server, body, param, needle):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param
    assert needle in error["message"]
