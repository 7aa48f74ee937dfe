"""A stop string that a request's output completes across a token boundary: its first
character arrives one step before its last (what the engine's hold-back of streamed text
exists for)."""

from __future__ import annotations

from itertools import pairwise

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def step_texts(engine: LLMEngine, prompt: str | list[int], params: SamplingParams, request_id: str) -> list[str]:
    """The request's cumulative output text after each step that produced output."""
    engine.add_request(request_id, prompt, params)
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step() if o.request_id == request_id]
    return texts


def boundary_stop(texts: list[str]) -> tuple[str, str]:
    """(stop string, the text it cuts the output to): the last character of one step's
    text and the first one the next step adds, taken at the first such boundary where
    that pair first occurs in the final text."""
    final = texts[-1]
    for before, after in pairwise(texts):
        if before and len(after) > len(before):
            stop = before[-1] + after[len(before)]
            if final.find(stop) == len(before) - 1:
                return stop, final[: len(before) - 1]
    raise AssertionError(f"no stop string spans a token boundary of {texts!r}")
