"""While a request runs, the text it streams never holds the start of a stop string that
a later token may complete: every intermediate text is a prefix of the final one."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.sampling_params import SamplingParams
from tests.engine.stop_strings import boundary_stop, step_texts

PROMPT = "The cache keeps what was computed once"


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=tiny_model_factory(), dtype="float32", num_kv_blocks=64)


def greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, **extra)


@pytest.mark.parametrize("padding", ["", "zzzz"])  # a longer stop string in the list holds more back
def test_streamed_text_never_shows_a_stop_string_in_the_making(llm, padding):
    stop, expected = boundary_stop(step_texts(llm.engine, PROMPT, greedy(), "plain"))
    stops = [stop, padding + stop] if padding else [stop]
    texts = step_texts(llm.engine, PROMPT, greedy(stop=stops), "stopped")
    assert texts[-1] == expected
    assert all(expected.startswith(text) for text in texts), texts
    finished = llm.generate([PROMPT], greedy(stop=stops), use_tqdm=False)[0].outputs[0]
    assert (finished.text, finished.finish_reason, finished.stop_reason) == (expected, "stop", stop)
