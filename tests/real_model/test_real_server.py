"""`kvtier serve --kv-offload cpu,disk` with no --model (the README's serve command)
serves SmolLM2, and the official openai client gets real answers, streamed or not."""

from __future__ import annotations

import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_default_model_is_served_under_its_builtin_name(client, server):
    assert [m.id for m in client.models.list().data] == ["builtin:smollm2"]
    assert "LlamaForCausalLM, 30 layers" in server.output


def test_chat_knows_the_capital_of_france(client):
    reply = client.chat.completions.create(model="builtin:smollm2", messages=QUESTION, max_tokens=24,
                                           temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"


def test_streamed_chat_equals_the_whole_reply(client):
    whole = client.chat.completions.create(model="builtin:smollm2", messages=QUESTION, max_tokens=24,
                                           temperature=0).choices[0].message.content
    stream = client.chat.completions.create(model="builtin:smollm2", messages=QUESTION, max_tokens=24,
                                            temperature=0, stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len([p for p in pieces if p]) > 1, "the reply arrives in several chunks"
    assert "".join(pieces) == whole
