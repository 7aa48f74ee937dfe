"""Incremental detokenization and stop strings.

Decoding only the new tokens on their own goes wrong in two ways: tokenizers that drop
the leading space of the first token (SentencePiece, Metaspace) lose spaces, and a
character whose UTF-8 bytes span several tokens decodes to U+FFFD until its last byte
arrives. So each step decodes a short window of already-emitted tokens with and without
the new ones and emits the difference, and emits nothing while the text ends in U+FFFD.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Prompt tokens decoded before the first output token, to give it its context.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Output text of one request, grown token by token. `text` holds the output so far
    (never the prompt)."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids)
        self.prefix_offset = max(len(self.token_ids) - PROMPT_CONTEXT_TOKENS, 0)
        self.read_offset = len(self.token_ids)
        self.text = ""

    def append(self, token_ids: Sequence[int]) -> str:
        """Add output tokens; returns the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset, len(self.token_ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
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

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(
            self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens
        )


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
