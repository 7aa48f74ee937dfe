"""Incremental detokenization and stop strings.

Decoding only the new tokens on their own goes wrong in two ways: tokenizers that drop
the leading space of the first token (SentencePiece, Metaspace) lose spaces, and a
character whose UTF-8 bytes span several tokens decodes to U+FFFD until its last byte
arrives. `tokenizers.decoders.DecodeStream` handles both in one decode per step: it
keeps a short window of already-emitted tokens (seeded with the end of the prompt) and
emits the difference, and nothing while the text would end in U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens the stream starts from, to give the first output token its context.
PROMPT_CONTEXT_TOKENS = 5


def backend_tokenizer(tokenizer: Any) -> Tokenizer:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer (or itself)."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"{type(tokenizer).__name__} is not a fast (tokenizers) tokenizer")
    return backend


class IncrementalDetokenizer:
    """Output text of one request, grown token by token. `text` holds the output so far
    (never the prompt)."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = backend_tokenizer(tokenizer)
        context = list(prompt_token_ids[max(len(prompt_token_ids) - PROMPT_CONTEXT_TOKENS, 0) :])
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self.text = ""

    def append(self, token_ids: Sequence[int]) -> str:
        """Add output tokens; returns the text they complete (possibly empty)."""
        if not token_ids:
            return ""
        delta = self._stream.step(self.tokenizer, list(token_ids)) or ""
        self.text += delta
        return delta

    def check_stop(self, stop: Sequence[str], num_new_chars: int) -> str | None:
        """Look for a stop string in text that the last `num_new_chars` characters could
        have completed. On a match, cut `text` before it and return the stop string."""
        found = find_stop_string(self.text, stop, num_new_chars)
        if found is None:
            return None
        index, stop_string = found
        self.text = self.text[:index]
        return stop_string


def find_stop_string(
    text: str, stop: Sequence[str], num_new_chars: int | None = None
) -> tuple[int, str] | None:
    """(index, stop string) of the earliest stop string in `text`, or None.

    With `num_new_chars`, only matches that end inside the last `num_new_chars`
    characters are looked for (earlier ones were found by earlier calls), so each call
    costs O(num_new_chars + longest stop string) instead of O(len(text)). Among matches
    at the same index the first listed stop string wins."""
    best: tuple[int, str] | None = None
    for stop_string in stop:
        start = 0
        if num_new_chars is not None:
            start = max(len(text) - num_new_chars - len(stop_string) + 1, 0)
        index = text.find(stop_string, start)
        if index >= 0 and (best is None or index < best[0]):
            best = (index, stop_string)
    return best
