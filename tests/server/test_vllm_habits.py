"""What vLLM users type: `kvtier serve MODEL`, --api-key (flag or VLLM_API_KEY /
KVTIER_API_KEY), --chat-template, several --served-model-name, /version, top logprobs up
to --max-logprobs, and n > 1 -- through a real server process and the openai client."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.server_helpers import (
    EAGER_OPS,
    MAX_MODEL_LEN,
    REPO_ROOT,
    STORELESS_KEY,
    ServerProcess,
)

KEY = "sk-test-key-0123"
NAMES = ("first-name", "second-name")
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"
MESSAGES = [{"role": "user", "content": "Say something."}]
PROMPT = "The quick brown fox jumps over the lazy dog and"
UNAUTHENTICATED = {
    "error": {
        "message": "You didn't provide an API key. You need to provide your API key in an "
        "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
        "type": "invalid_request_error", "param": None, "code": None,
    }
}


@pytest.fixture(scope="module")
def template_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return str(path)


@pytest.fixture(scope="module")
def server(model_path, template_file):
    """MODEL as the first argument, the key from vLLM's variable, two names."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "VLLM_API_KEY": KEY}
    env.pop("KVTIER_API_KEY", None)
    process = ServerProcess(
        model_path, "--dtype", "float32", "--num-kv-blocks", "128", "--max-model-len", str(MAX_MODEL_LEN),
        "--served-model-name", *NAMES, "--chat-template", template_file, "--max-logprobs", "5",
        "--log-level", "warning", EAGER_OPS, env=env,
    )
    yield process
    process.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


# ---- --api-key --------------------------------------------------------------------------


def test_v1_needs_the_key_with_openais_401(server):
    missing = httpx.get(server.url + "/v1/models")
    assert missing.status_code == 401 and missing.json() == UNAUTHENTICATED
    assert missing.headers["www-authenticate"] == "Bearer"
    wrong = httpx.post(server.url + "/v1/completions", json={"prompt": "x"},
                       headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401
    assert wrong.json()["error"]["code"] == "invalid_api_key" and KEY not in wrong.text
    unknown = httpx.get(server.url + "/v1/nothing-here")  # no probing of routes without the key
    assert unknown.status_code == 401


def test_the_openai_client_with_a_wrong_key_gets_authentication_error(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_health_metrics_version_stay_open(server):
    from engine import __version__

    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    assert httpx.get(server.url + "/ready").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/load").status_code == 200
    assert httpx.get(server.url + "/version").json() == {"version": __version__}


def test_the_key_also_comes_from_kvtier_api_key_and_the_flag(storeless_server):
    assert httpx.get(storeless_server.url + "/v1/models").status_code == 401
    ok = httpx.get(storeless_server.url + "/v1/models", headers={"Authorization": f"Bearer {STORELESS_KEY}"})
    assert ok.status_code == 200


# ---- names, MODEL, chat template ----------------------------------------------------------------


def test_every_served_name_is_listed_and_accepted(client, server, model_path):
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        reply = client.completions.create(model=name, prompt=PROMPT, max_tokens=2, temperature=0)
        assert reply.model == NAMES[0]
    assert f"model    {model_path}" in server.output


def test_the_chat_template_flag_replaces_the_models(client, model_path):
    rendered = "<user>Say something.\n<assistant>"
    expected = len(AutoTokenizer.from_pretrained(model_path)(rendered, add_special_tokens=False).input_ids)
    reply = client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=2, temperature=0)
    assert reply.usage.prompt_tokens == expected


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_model_given_twice_differently_is_an_error_naming_both(model_path):
    result = run_cli("serve", model_path, "--model", "builtin:tiny")
    assert result.returncode == 2
    assert "MODEL" in result.stderr and "--model" in result.stderr and "builtin:tiny" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_hub_id_is_one_line_saying_nothing_is_downloaded():
    result = run_cli("serve", "meta-llama/Llama-3-8B")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("kvtier serve: error: --model: meta-llama/Llama-3-8B") and "cannot download" in line


def test_a_chat_template_that_is_neither_file_nor_template_names_the_flag():
    result = run_cli("serve", "builtin:tiny", "--chat-template", "no/such/template.jinja")
    assert result.returncode == 2 and "--chat-template" in result.stderr and "Traceback" not in result.stderr


# ---- top logprobs ---------------------------------------------------------------------------


def test_completion_top_logprobs(client):
    reply = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    logprobs = reply.choices[0].logprobs
    assert len(logprobs.top_logprobs) == 4
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert 3 <= len(top) <= 4  # the k most likely, and the sampled token
        assert max(top.values()) == pytest.approx(logprob) and top[token] == pytest.approx(logprob)  # greedy


def test_chat_top_logprobs(client):
    reply = client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=3, temperature=0,
                                           logprobs=True, top_logprobs=5)
    for entry in reply.choices[0].logprobs.content:
        assert len(entry.top_logprobs) == 5
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].bytes == entry.bytes


def test_more_logprobs_than_max_logprobs_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as completion:
        client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=1, logprobs=6)
    assert completion.value.body["param"] == "logprobs" and "--max-logprobs" in completion.value.body["message"]
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=1, logprobs=True,
                                       top_logprobs=6)
    assert chat.value.body["param"] == "top_logprobs"


# ---- n > 1 -----------------------------------------------------------------------------------


def test_greedy_n_gives_n_equal_choices(client):
    one = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=6, temperature=0)
    many = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=6, temperature=0, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [one.choices[0].text] * 3
    assert many.usage.prompt_tokens == one.usage.prompt_tokens
    assert many.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_seeded_n_is_reproducible(client):
    def sample() -> list[str]:
        reply = client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=8, temperature=1.0,
                                               seed=11, n=4)
        return [c.message.content for c in reply.choices]

    first = sample()
    assert first == sample() and len(set(first)) > 1


def test_n_with_several_prompts_numbers_choices_prompt_major(client):
    reply = client.completions.create(model=NAMES[0], prompt=[PROMPT, "Once upon a time"], max_tokens=3,
                                      temperature=0, n=2)
    texts = [c.text for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert texts[0] == texts[1] and texts[2] == texts[3]


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_streamed_n_choices_carry_their_index(client, api):
    if api == "chat":
        whole = client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=8, temperature=1.0,
                                               seed=3, n=3)
        stream = client.chat.completions.create(model=NAMES[0], messages=MESSAGES, max_tokens=8, temperature=1.0,
                                                seed=3, n=3, stream=True)
        expected = [c.message.content for c in whole.choices]
    else:
        whole = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, n=3)
        stream = client.completions.create(model=NAMES[0], prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                           n=3, stream=True)
        expected = [c.text for c in whole.choices]
    texts, finishes = ["", "", ""], [[], [], []]
    for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content if api == "chat" else choice.text
            texts[choice.index] += piece or ""
            if choice.finish_reason:
                finishes[choice.index].append(choice.finish_reason)
    assert texts == expected
    assert finishes == [["length"]] * 3


def test_an_abandoned_n_stream_frees_every_block(server):
    body = {"model": NAMES[0], "prompt": PROMPT, "max_tokens": 200, "n": 4, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as response:
        seen = set()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen.update(c["index"] for c in json.loads(line[6:])["choices"])
            if len(seen) == 4:
                break  # leave with every choice running
    deadline = time.monotonic() + 30
    while True:
        metrics = httpx.get(server.url + "/metrics").text
        if _gauge(metrics, "vllm:num_requests_running") == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert _gauge(metrics, "vllm:num_requests_running") == 0
    assert _gauge(metrics, "vllm:kv_cache_usage_perc") == 0.0


def _gauge(metrics: str, name: str) -> float:
    [line] = [m for m in metrics.splitlines() if m.startswith(name + "{")]
    return float(line.rsplit(" ", 1)[1])


@pytest.mark.parametrize("flag", ["--model", "--tokenizer"])
def test_a_bad_model_or_tokenizer_path_is_one_line_naming_its_flag(flag, tmp_path):
    args = [str(tmp_path)] if flag == "--model" else ["builtin:tiny", "--tokenizer", str(tmp_path / "none")]
    result = run_cli("serve", *args, "--port", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert re.match(rf"kvtier serve: error: {flag}:? ", line), line  # a missing path is refused with the options
