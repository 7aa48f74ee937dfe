"""Prompt tokenization off the engine thread (engine/server/prompts.py): the same token
ids as the engine's own tokenization, and the length check that refuses a prompt
before the whole of it is tokenized."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from transformers import AutoTokenizer

from engine.blend import SegmentedTokens, Segments
from engine.server.errors import APIError
from engine.server.prompts import (
    LEND_CORE_CHARS,
    PREFIX_CHARS_PER_TOKEN,
    PromptTokenizer,
    PromptTooLongError,
)
from tests.server.server_helpers import MAX_MODEL_LEN

TEXTS = ["Hello there, how are you?", "  leading spaces\nand a newline wörld 🙂", "x"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 你好"}]


@pytest.fixture(scope="module")
def prompts(model_path) -> PromptTokenizer:
    return PromptTokenizer(AutoTokenizer.from_pretrained(model_path), MAX_MODEL_LEN)


def test_token_ids_equal_the_engines_own(prompts, offline_llm):
    engine = offline_llm.engine
    assert asyncio.run(prompts.encode(TEXTS)) == [engine.encode(t) for t in TEXTS]
    assert asyncio.run(prompts.encode([[5, 6, 7]])) == [[5, 6, 7]]
    assert asyncio.run(prompts.encode_chat(MESSAGES)) == engine.encode_chat(MESSAGES)


def test_prompt_of_max_model_len_tokens_is_refused_with_its_count(prompts, offline_llm):
    words = " ".join(["hello"] * MAX_MODEL_LEN)
    num_tokens = len(offline_llm.engine.encode(words))
    assert num_tokens >= MAX_MODEL_LEN
    with pytest.raises(PromptTooLongError, match=rf"alone has {num_tokens} tokens") as info:
        asyncio.run(prompts.encode([words]))
    assert (info.value.status, info.value.code, info.value.param) == (400, "context_length_exceeded", "prompt")
    with pytest.raises(PromptTooLongError, match=rf"alone has {MAX_MODEL_LEN} tokens"):
        asyncio.run(prompts.encode([[5] * MAX_MODEL_LEN]))
    assert len(asyncio.run(prompts.encode([[5] * (MAX_MODEL_LEN - 1)]))[0]) == MAX_MODEL_LEN - 1


def test_a_long_text_is_refused_from_its_prefix(prompts):
    huge = "some ordinary words of text, " * 100_000  # 2.9 M characters
    assert len(huge) > 100 * MAX_MODEL_LEN * max(PREFIX_CHARS_PER_TOKEN)
    with pytest.raises(PromptTooLongError, match=r"alone has at least \d+ tokens"):
        asyncio.run(prompts.encode([huge]))
    chat = [{"role": "user", "content": huge}]
    with pytest.raises(PromptTooLongError, match=r"messages alone has at least \d+ tokens"):
        asyncio.run(prompts.encode_chat(chat))


def test_dense_text_is_refused_from_its_shortest_prefix(prompts, monkeypatch):
    """Text of few characters a token overflows within the first prefix: nothing longer
    is tokenized."""
    seen: list[int] = []
    tokenize = prompts._tokenize
    monkeypatch.setattr(prompts, "_tokenize",
                        lambda text, special, param: seen.append(len(text)) or tokenize(text, special, param))
    dense = "a, b, c; " * 100_000
    with pytest.raises(PromptTooLongError, match=r"alone has at least \d+ tokens"):
        asyncio.run(prompts.encode([dense]))
    assert seen == [MAX_MODEL_LEN * PREFIX_CHARS_PER_TOKEN[0]]


def test_a_lone_surrogate_is_refused_where_the_text_is_tokenized(prompts):
    """Validation leaves a prompt's texts to the tokenizer's check: a lone surrogate in a
    text, in a segment or in the prefix a huge text is judged by is a 400 on that param."""
    for prompt in ["ok \ud800", Segments(["doc", "question \udc00"])]:
        with pytest.raises(APIError, match="lone UTF-16 surrogate") as raised:
            asyncio.run(prompts.encode([prompt], param="prompt"))
        assert (raised.value.status, raised.value.param, raised.value.code) == (400, "prompt", "invalid_value")
    huge_with_early_surrogate = "\ud800" + "a, b, c; " * 100_000
    with pytest.raises(APIError, match="lone UTF-16 surrogate"):
        asyncio.run(prompts.encode([huge_with_early_surrogate]))


def test_a_huge_prompt_is_refused_from_its_prefix_without_scanning_the_rest(http):
    """A lone surrogate past every prefix a refused prompt is judged by is never read: the
    answer is the prompt's length, not its surrogate."""
    body = {"model": "tiny", "prompt": "a, b, c; " * MAX_MODEL_LEN + "\ud800", "max_tokens": 2}
    raw = json.dumps(body).encode()  # ASCII with \u escapes: the lone surrogate survives
    response = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_a_long_text_whose_prefix_fits_is_tokenized_whole(prompts):
    # Nine characters a token (two of the tiny vocabulary's longest): the prefix fits
    # in max_model_len tokens, the whole text does not.
    long_tokens = " requests computed" * (MAX_MODEL_LEN * max(PREFIX_CHARS_PER_TOKEN) // 10)
    assert len(long_tokens) > MAX_MODEL_LEN * max(PREFIX_CHARS_PER_TOKEN)
    with pytest.raises(PromptTooLongError, match=r"alone has \d+ tokens"):
        asyncio.run(prompts.encode([long_tokens]))


def test_server_refuses_a_long_prompt_with_a_400(http):
    body = {"model": "tiny", "prompt": "word " * 12_000, "max_tokens": 2}
    response = http.post("/v1/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    assert "at least" in error["message"]
    assert http.post("/v1/completions", json={**body, "prompt": "word " * 10}).status_code == 200


def test_segmented_prompts_equal_the_engines_own(model_path, offline_llm):
    """Segments, and text or chat split at the request's or the default separator, give
    the engine's SegmentedTokens (each segment tokenized alone)."""
    engine = offline_llm.engine
    sep = "<S>"
    prompts = PromptTokenizer(AutoTokenizer.from_pretrained(model_path), MAX_MODEL_LEN, separator=sep)
    text = sep.join(TEXTS)
    expected = engine.encode(text, sep)
    assert isinstance(expected, SegmentedTokens) and len(expected.starts) == len(TEXTS)
    assert asyncio.run(prompts.encode([text])) == [expected]
    assert asyncio.run(prompts.encode([Segments(TEXTS)])) == [engine.encode(Segments(TEXTS))] == [expected]
    other = PromptTokenizer(prompts.tokenizer, MAX_MODEL_LEN)
    assert asyncio.run(other.encode([text])) == [engine.encode(text)]  # no separator: one plain prompt
    assert asyncio.run(other.encode([text], separator=sep)) == [expected]
    chat = [MESSAGES[0], {"role": "user", "content": f"{TEXTS[0]}{sep}{TEXTS[1]}"}]
    assert asyncio.run(prompts.encode_chat(chat)) == engine.encode_chat(chat, separator=sep)
    assert isinstance(engine.encode_chat(chat, separator=sep), SegmentedTokens)


def test_an_overlong_segmented_prompt_is_refused_from_its_prefix(prompts):
    huge = "some ordinary words of text, " * 100_000
    with pytest.raises(PromptTooLongError, match=r"segments alone has at least \d+ tokens"):
        asyncio.run(prompts.encode([Segments(["system", huge, "question"])], "segments"))
    with pytest.raises(PromptTooLongError, match=r"segments alone has \d+ tokens"):
        asyncio.run(prompts.encode([Segments(["word " * 200, "word " * 200])], "segments"))


class Loans:
    """A stand-in for AsyncEngine.lend_core that records whether each tokenization ran inside a loan."""

    def __init__(self, prompts: PromptTokenizer) -> None:
        self.open = 0
        self.tokenized_inside: list[bool] = []
        tokenize = prompts._tokenize

        def recording_tokenize(text, special, param):
            self.tokenized_inside.append(self.open == 1)
            return tokenize(text, special, param)

        prompts._tokenize = recording_tokenize

    @contextlib.asynccontextmanager
    async def lend(self):
        self.open += 1
        try:
            yield
        finally:
            self.open -= 1


@pytest.fixture
def lending(model_path) -> tuple[PromptTokenizer, Loans]:
    prompts = PromptTokenizer(AutoTokenizer.from_pretrained(model_path), MAX_MODEL_LEN)
    loans = Loans(prompts)
    prompts._lend_core = loans.lend
    return prompts, loans


def test_long_prompts_are_tokenized_on_a_lent_core_and_short_ones_are_not(lending):
    prompts, loans = lending
    long_text = "w" * LEND_CORE_CHARS
    asyncio.run(prompts.encode(["short"]))
    with pytest.raises(PromptTooLongError):
        asyncio.run(prompts.encode(["w" * (LEND_CORE_CHARS - 1)]))
    assert loans.tokenized_inside and not any(loans.tokenized_inside)
    loans.tokenized_inside.clear()
    for work in (prompts.encode([long_text]), prompts.encode_chat([{"role": "user", "content": long_text}]),
                 prompts.encode([Segments(["w" * (LEND_CORE_CHARS // 2)] * 2)])):
        with contextlib.suppress(PromptTooLongError):
            asyncio.run(work)
        assert loans.tokenized_inside and all(loans.tokenized_inside)
        loans.tokenized_inside.clear()
    assert loans.open == 0


def test_a_lent_core_is_given_back_when_the_prompt_is_refused(lending):
    prompts, loans = lending
    with pytest.raises(PromptTooLongError):
        asyncio.run(prompts.encode(["some ordinary words of text, " * 100_000]))
    with pytest.raises(APIError, match="lone UTF-16 surrogate"):
        asyncio.run(prompts.encode(["\ud800" + "w" * LEND_CORE_CHARS]))
    assert loans.tokenized_inside and all(loans.tokenized_inside)
    assert loans.open == 0
