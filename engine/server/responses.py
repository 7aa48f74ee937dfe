"""Engine outputs -> OpenAI response bodies, stream chunks and server-sent events."""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from fastapi.responses import Response
from pydantic import BaseModel

from engine.logprobs import PromptLogprobs, TopLogprobs
from engine.outputs import CompletionOutput, RequestOutput
from engine.server.errors import APIError
from engine.server.protocol import (
    ChatChunkChoice,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCallItem,
    UsageInfo,
)
from engine.tool_calls import ToolCallParser, ToolCallStream

TokenText = Callable[[int], str]
DONE_EVENT = "data: [DONE]\n\n"


def json_response(body: BaseModel) -> Response:
    """`body` as an `application/json` response; a non-finite float becomes `null`
    (JSON has no NaN or infinity; `JSONResponse` would raise instead)."""
    return Response(body.model_dump_json(), media_type="application/json")


def sse(body: BaseModel) -> str:
    """One server-sent event carrying `body` as JSON (non-finite floats as `null`)."""
    return f"data: {body.model_dump_json()}\n\n"


def error_event(error: APIError) -> str:
    body = error.to_response().body.decode()
    return f"data: {body}\n\n"


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Each prompt counts once, however many completions (n) it has."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def choices(outputs: list[RequestOutput], n: int) -> Iterator[tuple[int, CompletionOutput]]:
    """(choice index, completion) of every completion: prompt i's completion j is choice
    i * n + j, as OpenAI and vLLM number them."""
    for i, output in enumerate(outputs):
        for completion in output.outputs:
            yield i * n + completion.index, completion


def generation_error(output: RequestOutput) -> APIError | None:
    """The error of a request the engine failed (its batch crashed), if any."""
    if output.error is None:
        return None
    return APIError(500, f"generation failed: {output.error}", type="server_error",
                    code="generation_failed")


@dataclass
class Delta:
    """What a stream chunk adds: new text, new token ids and their logprobs; a choice's
    first delta also carries its prompt (for `echo`) when the tracker was given it."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[TopLogprobs] | None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: PromptLogprobs | None = None


class DeltaTracker:
    """Remembers how much of one completion's cumulative output was already sent, and
    whether its finish was."""

    def __init__(self) -> None:
        self._chars = 0
        self._tokens = 0
        self._finish_sent = False
        self._prompt_sent = False

    def finish(self, completion: CompletionOutput) -> str | None:
        """The completion's finish reason the first time it is asked once it has one."""
        if completion.finish_reason is None or self._finish_sent:
            return None
        self._finish_sent = True
        return completion.finish_reason

    def advance(self, completion: CompletionOutput, output: RequestOutput | None = None) -> Delta:
        """What `completion` adds since the last call; the first call that adds tokens
        (or finishes) also hands on the prompt of `output`, the completion's request."""
        text = completion.text[self._chars :]
        token_ids = completion.token_ids[self._tokens :]
        logprobs = None
        if completion.logprobs is not None:
            entries = completion.logprobs[self._tokens :]
            logprobs = [step[token_id].logprob for step, token_id in zip(entries, token_ids, strict=True)]
        top = completion.top_logprobs[self._tokens :] if completion.top_logprobs is not None else None
        self._chars = max(self._chars, len(completion.text))
        self._tokens = len(completion.token_ids)
        delta = Delta(text, token_ids, logprobs, top)
        if output is not None and not self._prompt_sent and (token_ids or completion.finish_reason):
            self._prompt_sent = True
            delta.prompt_token_ids, delta.prompt_logprobs = output.prompt_token_ids, output.prompt_logprobs
        return delta


def completion_logprobs(
    delta: Delta, token_text: TokenText, with_top: bool, text_offset: int = 0
) -> CompletionLogprobs | None:
    """Legacy completions logprobs: per token its text, logprob and offset, and with
    `logprobs` >= 1 a {text: logprob} map of the most likely tokens and the sampled one
    (k + 1 entries when the sampled token is not among the k, as OpenAI and vLLM)."""
    if delta.logprobs is None:
        return None
    tokens = [token_text(t) for t in delta.token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    top_logprobs = None
    if with_top:
        top_logprobs = [
            {token_text(t): lp for t, lp in top} | {token: logprob}
            for token, logprob, top in zip(tokens, delta.logprobs, delta.top_logprobs, strict=True)
        ]
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=delta.logprobs, top_logprobs=top_logprobs, text_offset=offsets
    )


def echo_logprobs(
    token_ids: list[int], prompt_logprobs: PromptLogprobs, token_text: TokenText, num_top: int
) -> CompletionLogprobs:
    """Legacy completions logprobs of an echoed prompt, as OpenAI and vLLM give them: the
    first token's logprob and top logprobs None, then each token's, with `num_top` >= 1 the
    {text: logprob} map of its position's `num_top` most likely tokens and itself."""
    tokens = [token_text(t) for t in token_ids]
    token_logprobs: list[float | None] = [None]
    top_logprobs: list[dict[str, float] | None] = [None]
    for token_id, token, entries in zip(token_ids[1:], tokens[1:], prompt_logprobs[1:], strict=True):
        token_logprobs.append(entries[token_id].logprob)
        ranked = sorted((e.rank, t, e.logprob) for t, e in entries.items() if e.rank is not None and e.rank <= num_top)
        top_logprobs.append({token_text(t): lp for _, t, lp in ranked} | {token: entries[token_id].logprob})
    offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs,
                              top_logprobs=top_logprobs if num_top > 0 else None, text_offset=offsets)


def _joined(first: CompletionLogprobs, second: CompletionLogprobs | None) -> CompletionLogprobs:
    """`first`'s tokens then `second`'s (whose text offsets already follow `first`'s)."""
    if second is None:
        return first
    top = None if first.top_logprobs is None else first.top_logprobs + (second.top_logprobs or [])
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens, token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=top, text_offset=first.text_offset + second.text_offset,
    )


def _chat_token(token_id: int, logprob: float, token_text: TokenText) -> dict:
    token = token_text(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(delta: Delta, token_text: TokenText) -> ChatLogprobs | None:
    """Chat logprobs: per token its entry and `top_logprobs` most likely tokens' entries."""
    if delta.logprobs is None:
        return None
    content = []
    for token_id, logprob, top in zip(delta.token_ids, delta.logprobs, delta.top_logprobs, strict=True):
        alternatives = [_chat_token(t, lp, token_text) for t, lp in top]
        content.append(ChatTokenLogprob(**_chat_token(token_id, logprob, token_text), top_logprobs=alternatives))
    return ChatLogprobs(content=content)


# ---- the two APIs' output shapes -----------------------------------------------------


class OutputFormat(Protocol):
    """How one API shapes engine outputs: stream chunks, and the one-shot response."""

    def head_chunks(self) -> list[BaseModel]: ...

    def chunk(self, index: int, delta: Delta, finish: str | None) -> BaseModel: ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def response(self, outputs: list[RequestOutput]) -> BaseModel: ...



class CompletionFormat:
    """`echo`: the text of each prompt, which each of its choices starts with (with
    `logprobs`, its tokens' logprobs come first too, from the outputs' prompt logprobs)."""

    def __init__(
        self, request_id: str, model: str, token_text: TokenText, logprobs: int | None, n: int = 1,
        echo: list[str] | None = None,
    ) -> None:
        self._id = request_id
        self._n = n
        self._model = model
        self._created = int(time.time())
        self._token_text = token_text
        self._logprobs = logprobs
        self._echo = echo
        self._text_offsets: dict[int, int] = defaultdict(int)

    def head_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, index: int, delta: Delta, finish: str | None) -> CompletionChunk:
        choice = CompletionChoice(
            index=index, text=self._text_of(index, delta), logprobs=self._logprobs_of(index, delta),
            finish_reason=finish,
        )
        return CompletionChunk(id=self._id, created=self._created, model=self._model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> CompletionChunk:
        return CompletionChunk(id=self._id, created=self._created, model=self._model, choices=[], usage=usage)

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        answers = []
        for index, completion in sorted(choices(outputs, self._n), key=lambda c: c[0]):
            output = outputs[index // self._n]
            delta = DeltaTracker().advance(completion, output)
            answers.append(CompletionChoice(
                index=index, text=self._text_of(index, delta), logprobs=self._logprobs_of(index, delta),
                finish_reason=completion.finish_reason, prompt_logprobs=output.prompt_logprobs,
            ))
        return CompletionResponse(
            id=self._id, created=self._created, model=self._model, choices=answers, usage=usage_of(outputs)
        )

    def _echoes(self, delta: Delta) -> bool:
        return self._echo is not None and delta.prompt_token_ids is not None

    def _text_of(self, index: int, delta: Delta) -> str:
        return self._echo[index // self._n] + delta.text if self._echoes(delta) else delta.text

    def _logprobs_of(self, index: int, delta: Delta) -> CompletionLogprobs | None:
        if self._logprobs is None:
            return None
        echoed = None
        if self._echoes(delta):
            echoed = echo_logprobs(delta.prompt_token_ids, delta.prompt_logprobs, self._token_text, self._logprobs)
            self._text_offsets[index] += sum(len(t) for t in echoed.tokens)
        result = completion_logprobs(delta, self._token_text, self._logprobs > 0, self._text_offsets[index])
        self._text_offsets[index] += sum(len(t) for t in result.tokens) if result else 0
        return result if echoed is None else _joined(echoed, result)


class ChatFormat:
    """Chat output; with a tool-call parser (tools offered, tool_choice not "none") the
    text is read for tool calls, sent as `tool_calls` instead of content."""

    def __init__(
        self, request_id: str, model: str, token_text: TokenText, n: int = 1,
        tool_parser: ToolCallParser | None = None,
    ) -> None:
        self._id = request_id
        self._n = n
        self._model = model
        self._created = int(time.time())
        self._token_text = token_text
        self._tool_parser = tool_parser
        self._tool_streams: dict[int, ToolCallStream] = {}

    def head_chunks(self) -> list[BaseModel]:
        return [
            self._chunk([ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))])
            for i in range(self._n)
        ]

    def chunk(self, index: int, delta: Delta, finish: str | None) -> ChatCompletionChunk:
        logprobs = chat_logprobs(delta, self._token_text)
        if self._tool_parser is None:
            content = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
            return self._chunk([ChatChunkChoice(index=index, delta=content, logprobs=logprobs, finish_reason=finish)])
        stream = self._tool_streams.setdefault(index, self._tool_parser.stream())
        text, pieces = stream.feed(delta.text)
        if finish is not None:
            rest, more = stream.finish()
            text, pieces = text + rest, pieces + more
        tool_deltas = [
            DeltaToolCall(index=piece.index, id=piece.id, type="function" if piece.id else None,
                          function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))
            for piece in pieces
        ]
        message = DeltaMessage(content=text or None, tool_calls=tool_deltas or None)
        finish = _tool_finish(finish, stream.calls > 0)
        return self._chunk([ChatChunkChoice(index=index, delta=message, logprobs=logprobs, finish_reason=finish)])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        answers = []
        for index, completion in sorted(choices(outputs, self._n), key=lambda c: c[0]):
            delta = DeltaTracker().advance(completion)
            content, calls = (delta.text, []) if self._tool_parser is None else self._tool_parser.parse(delta.text)
            answers.append(ChatCompletionChoice(
                index=index,
                message=ChatResponseMessage(content=content, tool_calls=[
                    ToolCallItem(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls
                ]),
                logprobs=chat_logprobs(delta, self._token_text),
                finish_reason=_tool_finish(completion.finish_reason, bool(calls)),
            ))
        return ChatCompletionResponse(
            id=self._id, created=self._created, model=self._model, choices=answers, usage=usage_of(outputs),
            prompt_logprobs=outputs[0].prompt_logprobs,
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
        )


def _tool_finish(finish: str | None, made_calls: bool) -> str | None:
    """OpenAI's finish reason of a choice that stopped by itself after calling tools."""
    return "tool_calls" if finish == "stop" and made_calls else finish
