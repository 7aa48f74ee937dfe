"""Response bodies are valid JSON whatever the numbers: a non-finite logprob is `null`,
in one-shot responses and in stream events alike."""

from __future__ import annotations

import json
import math

from engine.logprobs import Logprob
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.server.responses import ChatFormat, CompletionFormat, DeltaTracker, json_response, sse

LOGPROBS = [float("nan"), float("-inf"), -0.25, float("inf")]


def output() -> RequestOutput:
    token_ids = [10, 11, 12, 13]
    completion = CompletionOutput(index=0, text="abcd", token_ids=token_ids, finish_reason="length",
                                  logprobs=[{t: Logprob(lp, 1, token_text(t))} for t, lp in zip(token_ids, LOGPROBS, strict=True)],
                                  top_logprobs=[[] for _ in LOGPROBS])
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2], outputs=[completion],
                         finished=True, metrics=RequestMetrics(arrival_time=0.0))


def token_text(token_id: int) -> str:
    return chr(ord("a") + token_id - 10)


def expected() -> list[float | None]:
    return [lp if math.isfinite(lp) else None for lp in LOGPROBS]


def test_completion_response_writes_non_finite_logprobs_as_null():
    body = json.loads(json_response(CompletionFormat("id", "m", token_text, 1).response([output()])).body)
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == expected()
    assert [next(iter(top.values())) for top in logprobs["top_logprobs"]] == expected()


def test_chat_response_writes_non_finite_logprobs_as_null():
    body = json.loads(json_response(ChatFormat("id", "m", token_text).response([output()])).body)
    assert [entry["logprob"] for entry in body["choices"][0]["logprobs"]["content"]] == expected()


def test_stream_events_write_non_finite_logprobs_as_null():
    fmt = CompletionFormat("id", "m", token_text, 1)
    event = sse(fmt.chunk(0, DeltaTracker().advance(output().outputs[0]), "length"))
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert json.loads(event.removeprefix("data: "))["choices"][0]["logprobs"]["token_logprobs"] == expected()
