"""Tool calls through the official `openai` client against a real `kvtier serve` (the tiny
model, whose template takes no tools: the default rendering): named and required calls
are valid calls with schema-valid arguments, whole and streamed; a tool loop's history
(assistant calls, tool results) is accepted; tool_choice is checked."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.server.server_helpers import EAGER_OPS, MODEL_NAME, ServerProcess

pytestmark = pytest.mark.timeout(180)

LOOKUP = {"type": "function", "function": {
    "name": "lookup_order", "description": "Find an order",
    "parameters": {"type": "object", "properties": {
        "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "channel": {"enum": ["web", "phone"]}},
        "required": ["order_id", "channel"], "additionalProperties": False}}}
REFUND = {"type": "function", "function": {
    "name": "refund", "strict": True,
    "parameters": {"type": "object", "properties": {
        "amount": {"type": "number", "minimum": 0, "maximum": 500},
        "reason": {"type": "string", "maxLength": 8}},
        "required": ["amount", "reason"]}}}
TOOLS = [LOOKUP, REFUND]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Where is my order 1234?"}]


@pytest.fixture(scope="module")
def server(model_path):
    """A server with room for the tools: the tiny model's byte-level tokens make their
    default rendering some 700 tokens long."""
    process = ServerProcess("--model", model_path, "--dtype", "float32", "--num-kv-blocks", "512",
                            "--max-model-len", "2048", "--served-model-name", MODEL_NAME,
                            "--log-level", "warning", EAGER_OPS)
    yield process
    process.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def check_calls(calls, names):
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "refund"}}],
                         ids=["required", "named"])
def test_forced_calls_are_valid(client, choice):
    names = {"refund"} if isinstance(choice, dict) else set(SCHEMAS)
    for seed in range(3):
        # one call: a random model never stops adding parallel calls by itself
        reply = client.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=150,
            temperature=1.0, seed=seed, parallel_tool_calls=False)
        answer = reply.choices[0]
        assert answer.finish_reason == "tool_calls"
        assert answer.message.content is None
        check_calls(answer.message.tool_calls, names)
        assert len(answer.message.tool_calls) == 1


def test_streamed_calls_assemble_into_the_calls_of_the_whole_answer(client):
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=150,
                  temperature=0, parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    pieces = 0
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            assert not choice.delta.content
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                assert (delta.id is not None) == (delta.function.name is not None) == (call["name"] == "")
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
                pieces += 1
            finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    assert pieces > len(calls)  # the arguments streamed as they were written, not in one piece
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())] == \
        [(c.function.name, json.loads(c.function.arguments)) for c in whole]


def test_a_tool_loop_history_is_served(client):
    first = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                           tool_choice="required", max_tokens=150, temperature=0,
                                           parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    history = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": '{"status": "shipped"}'}]
    second = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS,
                                            max_tokens=8, temperature=0)
    answer = second.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    # the turn replays the first one's prompt: its blocks come from the cache
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 16
    none = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS,
                                          tool_choice="none", max_tokens=8, temperature=0)
    assert none.choices[0].message.content and not none.choices[0].message.tool_calls


def test_auto_answers_plain_text_as_content(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                           temperature=0)
    answer = reply.choices[0]
    assert answer.finish_reason == "length"
    assert answer.message.content and not answer.message.tool_calls


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_tool_requests_that_cannot_be_served_are_400s(server, body, param):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 8, **body})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


@pytest.fixture(scope="module", params=["hermes", "llama3_json"])
def template_server(request, model_path, tmp_path_factory):
    """A server whose chat template takes tools (Qwen2.5-style for hermes, Llama-3.1-style
    for llama3_json), with the matching --tool-call-parser."""
    from tests.engine.tool_templates import LLAMA3_STYLE, QWEN_STYLE

    template = tmp_path_factory.mktemp("templates") / f"{request.param}.jinja"
    template.write_text(QWEN_STYLE if request.param == "hermes" else LLAMA3_STYLE)
    process = ServerProcess("--model", model_path, "--dtype", "float32", "--num-kv-blocks", "512",
                            "--max-model-len", "2048", "--served-model-name", MODEL_NAME,
                            "--log-level", "warning", EAGER_OPS, "--chat-template", str(template),
                            "--tool-call-parser", request.param)
    yield process
    process.stop()


def test_a_template_that_takes_tools_serves_calls_in_its_parsers_format(template_server):
    client = openai.OpenAI(base_url=template_server.url + "/v1", api_key="unused", max_retries=0)
    with_tools = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "refund"}},
        max_tokens=150, temperature=0)
    check_calls(with_tools.choices[0].message.tool_calls, {"refund"})
    without = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=1, temperature=0)
    # the template rendered the tools: the prompt holds their schemas
    assert with_tools.usage.prompt_tokens > without.usage.prompt_tokens + len(json.dumps(TOOLS)) // 4
