"""Logprobs as the engine reports them, shaped like vLLM's.

The sampler and the model runner record, per token, a `TokenLogprob` (the token's
logprob and rank) and its `TopLogprobs` (the k most likely tokens). What the `LLM` API
returns are vLLM's structures built from those records: per position a dict
{token id: Logprob(logprob, rank, decoded_token)} holding the token itself and the top k,
so code written against vLLM's `CompletionOutput.logprobs` and
`RequestOutput.prompt_logprobs` runs unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

TopLogprobs = list[tuple[int, float]]  # (token id, logprob), most likely first
# id -> the text of that token alone (what vLLM's `decoded_token` holds)
TokenText = Callable[[int], str]
# Decoded tokens kept per engine: the ids that logprobs name recur (the top k of
# consecutive steps overlap), and decoding one costs a tokenizer call.
TOKEN_TEXT_CACHE = 65536


class TokenLogprob(NamedTuple):
    """A token's logprob under the raw logits and its rank in the vocabulary, as vLLM
    counts it: 1 + the tokens more likely, ties counted (a greedy token has rank 1)."""

    logprob: float
    rank: int


@dataclass
class Logprob:
    """vLLM's `Logprob`: one token's logprob, its rank (1: most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per output token: the sampled token and the top k.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first (nothing predicts it), then the token and the top k.
PromptLogprobs = list[dict[int, Logprob] | None]


def logprob_entries(token_id: int, token: TokenLogprob, top: TopLogprobs, token_text: TokenText) -> dict[int, Logprob]:
    """vLLM's dict for one position: the token first, then the top k ranked 1..k (a token
    that is among them keeps its top-k entry, as in vLLM)."""
    entries = {token_id: Logprob(token.logprob, token.rank, token_text(token_id))}
    for rank, (top_id, logprob) in enumerate(top, start=1):
        entries[top_id] = Logprob(logprob, rank, token_text(top_id))
    return entries


def token_text_function(tokenizer: Any) -> TokenText:
    """id -> the text of that token decoded alone (vLLM's `decoded_token`), cached."""

    @functools.lru_cache(maxsize=TOKEN_TEXT_CACHE)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return token_text
