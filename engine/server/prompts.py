"""Prompt tokenization for the server, off the engine thread and length-checked first.

The engine thread runs every step, so a prompt tokenized there (8 MB of text takes
seconds) stalls every running stream. `PromptTokenizer` tokenizes in a worker thread
(asyncio's default executor), through the Rust tokenizer's batch call, which releases
the GIL while it works, so the engine thread and the event loop keep running meanwhile.
A text prompt longer than `max_model_len * 8` characters is first tokenized only up to
`max_model_len * 4` characters, then `max_model_len * 8` (`PREFIX_CHARS_PER_TOKEN`): when
such a prefix alone leaves no room for an output token, the request is refused without
tokenizing the rest. Every text is checked for lone surrogates just before it is
tokenized (a prompt's validation leaves that to this module), so a refused prompt's
rest is not even scanned. A prompt of LEND_CORE_CHARS characters or more is tokenized on
a core the engine lends (`AsyncEngine.lend_core`): the worker thread then does not take one
from the engine's OpenMP team mid-step.

A segmented prompt (the completions API's `segments`, or text split at the request's
`kv_blend_separator` or else `--kv-blend-separator`) is tokenized segment by segment
like `LLMEngine.encode` does, into `SegmentedTokens` (engine/blend), which the engine
blends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, TypeVar

from jinja2.exceptions import TemplateError

from engine.blend import SegmentedTokens, Segments, split_text, tokenize_segments
from engine.detokenizer import backend_tokenizer
from engine.server.errors import APIError
from engine.server.protocol import ChatCompletionRequest, CompletionRequest, check_unicode
from engine.tool_calls import ToolCallParser, render_messages, template_takes_tools

T = TypeVar("T")
# Characters of a text prompt tokenized before the whole, per token of context, tried in
# turn: English prose averages about four characters a token and code about three, so a
# prefix of four times as many characters as the context has tokens usually overflows it
# already when the prompt does, and one of eight times does.
PREFIX_CHARS_PER_TOKEN = (4, 8)
# Prompts of at least this many characters (about 4,000 tokens, a few milliseconds of
# tokenizing) are tokenized on a lent core; a loan waits for the engine's next step
# boundary, which a short prompt need not.
LEND_CORE_CHARS = 16 * 1024
# A prefix cut inside a word can tokenize into a few more tokens than the same
# characters do in the whole text; a prefix is judged too long only past this margin.
CUT_MARGIN_TOKENS = 16


def completion_prompts(body: CompletionRequest) -> tuple[list[str | list[int] | Segments], str]:
    """A completion request's prompts and the parameter that holds them."""
    if body.segments is None:
        return body.prompt, "prompt"
    return [Segments(body.segments)], "segments"


class PromptTooLongError(APIError):
    """A prompt that leaves no room for an output token within max_model_len."""

    def __init__(self, max_model_len: int, num_tokens: int, param: str, at_least: bool) -> None:
        count = f"at least {num_tokens}" if at_least else str(num_tokens)
        super().__init__(
            400,
            f"This model's maximum context length is {max_model_len} tokens, and the "
            f"{param} alone has {count} tokens: no room for any output.",
            param=param, code="context_length_exceeded",
        )


class PromptTokenizer:
    """Tokenizes completion prompts and chat messages like `LLMEngine.encode` and
    `encode_chat` do, in a worker thread; raises PromptTooLongError for a prompt of
    `max_model_len` tokens or more. `tokenizer` is a transformers fast tokenizer that the
    engine thread does not use (the worker threads only read it); `separator` is
    --kv-blend-separator; `lend_core` is AsyncEngine.lend_core."""

    def __init__(
        self, tokenizer: Any, max_model_len: int, separator: str | None = None,
        lend_core: Callable[[], AbstractAsyncContextManager[None]] = nullcontext,
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = backend_tokenizer(tokenizer)
        self.max_model_len = max_model_len
        self.separator = separator
        self._lend_core = lend_core

    async def encode(
        self, prompts: Sequence[str | list[int] | Segments], param: str = "prompt", separator: str | None = None
    ) -> list[list[int] | SegmentedTokens]:
        """Token ids of each prompt (text, ids or segments), checked against
        max_model_len; text that `separator` (else --kv-blend-separator) splits is
        segmented."""
        separator = separator or self.separator
        token_lists = []
        for prompt in prompts:
            if isinstance(prompt, str) and (segments := split_text(prompt, separator)) is not None:
                prompt = segments
            if isinstance(prompt, Segments):
                chars = sum(len(p) for p in prompt.parts if isinstance(p, str))
                token_ids = await self._run(chars, self._encode_segments, prompt, True, param)
            elif isinstance(prompt, str):
                token_ids = await self._run(len(prompt), self._encode_text, prompt, True, param)
            else:
                token_ids = list(prompt)
                self._check(len(token_ids), param, at_least=False)
            token_lists.append(token_ids)
        return token_lists

    async def encode_chat_request(self, body: ChatCompletionRequest, parser: ToolCallParser) -> list[int] | SegmentedTokens:
        """A chat completion request's prompt as the engine gets it: its messages and
        offered tools rendered for `parser` (--tool-call-parser) and the chat template,
        tokenized (the server, and `kvtier router` to name its blocks as the server will)."""
        messages, template_tools = render_messages(
            [m.template_dict() for m in body.messages], body.offered_tools, parser,
            template_takes_tools(self.tokenizer.chat_template),
        )
        return await self.encode_chat(messages, "messages", body.kv_blend_separator, template_tools)

    async def encode_completion_request(self, body: CompletionRequest) -> list[list[int] | SegmentedTokens]:
        """A completion request's prompts (or its segments) as the engine gets them."""
        return await self.encode(*completion_prompts(body), body.kv_blend_separator)

    async def encode_chat(
        self, messages: list[dict], param: str = "messages", separator: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[int] | SegmentedTokens:
        """The chat template applied to `messages` (with the generation prompt, and
        `tools` for a template that takes them), tokenized; segmented where `separator`
        (else --kv-blend-separator) occurs in a message."""
        chars = sum(len(m["content"]) for m in messages)
        return await self._run(chars, self._encode_chat, messages, separator or self.separator, param, tools)

    async def tokenize(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """`text` tokenized as it is, with the checks of a prompt (POST /tokenize)."""
        return await self._run(len(text), self._encode_text, text, add_special_tokens, param)

    async def tokenize_chat(
        self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool, param: str = "messages"
    ) -> list[int]:
        """`messages` through the chat template, tokenized, with the checks of a prompt
        (POST /tokenize)."""
        chars = sum(len(m["content"]) for m in messages)
        return await self._run(chars, self._render_and_encode, messages, add_generation_prompt,
                               add_special_tokens, param)

    async def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids`, special tokens included (POST /detokenize, and a token
        prompt's `echo`), in a worker thread."""
        return await self._run(len(token_ids), self.tokenizer.decode, token_ids)

    def _render_and_encode(
        self, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool, param: str
    ) -> list[int]:
        return self._encode_text(self._render_chat(messages, param, add_generation_prompt), add_special_tokens, param)

    async def _run(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a worker thread, on a lent core for `chars` of LEND_CORE_CHARS or more."""
        if chars < LEND_CORE_CHARS:
            return await asyncio.to_thread(fn, *args)
        async with self._lend_core():
            return await asyncio.to_thread(fn, *args)

    def _encode_chat(
        self, messages: list[dict], separator: str | None, param: str, tools: list[dict] | None = None
    ) -> list[int] | SegmentedTokens:
        text = self._render_chat(messages, param, tools=tools)
        # The rendered template carries its own special tokens, as apply_chat_template's
        # own tokenization assumes.
        if separator and any(separator in m["content"] for m in messages):
            segments = split_text(text, separator)
            if segments is not None:
                return self._encode_segments(segments, False, param)
        return self._encode_text(text, False, param)

    def _render_chat(
        self, messages: list[dict], param: str, add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> str:
        """The chat template's text for `messages`; a template that fails on them is a 400
        naming the cause: its own `raise_exception`, an error in it (TemplateError), or a
        limit of Jinja's sandbox that stopped it (`range()` beyond MAX_RANGE items is an
        OverflowError), since the messages are what made it fail."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, tools=tools)
        except (TemplateError, OverflowError) as exc:
            raise APIError(400, f"the chat template failed on these {param}: {type(exc).__name__}: {exc}",
                           param=param, code="invalid_value") from None

    def _encode_segments(self, segments: Segments, add_special_tokens: bool, param: str) -> SegmentedTokens:
        texts = [p for p in segments.parts if isinstance(p, str)]
        # as for one text: the joined prefixes refuse an overlong prompt before its whole is tokenized
        self._check_prefixes("".join(texts), add_special_tokens, param)
        token_ids = tokenize_segments(lambda text, first: self._tokenize(text, first, param), segments,
                                      add_special_tokens)
        self._check(len(token_ids), param, at_least=False)
        return token_ids

    def _encode_text(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        self._check_prefixes(text, add_special_tokens, param)
        token_ids = self._tokenize(text, add_special_tokens, param)
        self._check(len(token_ids), param, at_least=False)
        return token_ids

    def _check_prefixes(self, text: str, add_special_tokens: bool, param: str) -> None:
        """Refuse `text`, when it is longer than its longest PREFIX_CHARS_PER_TOKEN prefix,
        as soon as one of those prefixes overflows the context. (A shorter text is
        tokenized whole, and a refusal gives its exact count.)"""
        if len(text) <= self.max_model_len * PREFIX_CHARS_PER_TOKEN[-1]:
            return
        for chars_per_token in PREFIX_CHARS_PER_TOKEN:
            end = self.max_model_len * chars_per_token
            num_prefix = len(self._tokenize(text[:end], add_special_tokens, param))
            if num_prefix - CUT_MARGIN_TOKENS >= self.max_model_len:
                raise PromptTooLongError(self.max_model_len, num_prefix - CUT_MARGIN_TOKENS, param, at_least=True)

    def _tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """The token ids of `text`, refused (400) if it holds a lone surrogate: every text the
        tokenizer gets is checked here, so that a huge prompt refused from its prefixes is
        never scanned whole (the check is a pass over the text that holds the GIL)."""
        try:
            check_unicode(text)
        except ValueError as exc:
            raise APIError(400, f"The {param} {exc}.", param=param, code="invalid_value") from None
        # encode_batch releases the GIL while it tokenizes; encode does not.
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _check(self, num_tokens: int, param: str, at_least: bool) -> None:
        if num_tokens >= self.max_model_len:
            raise PromptTooLongError(self.max_model_len, num_tokens, param, at_least)
