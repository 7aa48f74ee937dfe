"""Engine outputs -> OpenAI response bodies, stream chunks and server-sent events."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fastapi.responses import Response
from pydantic import BaseModel

from engine.outputs import RequestOutput
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
    DeltaMessage,
    PromptTokensDetails,
    UsageInfo,
)

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
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(o.outputs[0].token_ids) for o in outputs)
    cached = sum(o.metrics.num_cached_tokens for o in outputs)
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def finish_reason(output: RequestOutput) -> str | None:
    return output.outputs[0].finish_reason if output.finished else None


def generation_error(output: RequestOutput) -> APIError | None:
    """The error of a request the engine failed (its batch crashed), if any."""
    if output.error is None:
        return None
    return APIError(500, f"generation failed: {output.error}", type="server_error",
                    code="generation_failed")


@dataclass
class Delta:
    """What a stream chunk adds: new text, new token ids and their logprobs."""

    text: str
    token_ids: list[int]
    logprobs: list[float] | None


class DeltaTracker:
    """Remembers how much of one request's cumulative output was already sent."""

    def __init__(self) -> None:
        self._chars = 0
        self._tokens = 0

    def advance(self, output: RequestOutput) -> Delta:
        completion = output.outputs[0]
        text = completion.text[self._chars :]
        token_ids = completion.token_ids[self._tokens :]
        logprobs = completion.logprobs[self._tokens :] if completion.logprobs is not None else None
        self._chars = max(self._chars, len(completion.text))
        self._tokens = len(completion.token_ids)
        return Delta(text, token_ids, logprobs)


def completion_logprobs(
    delta: Delta, token_text: TokenText, with_top: bool, text_offset: int = 0
) -> CompletionLogprobs | None:
    """Legacy completions logprobs; `top_logprobs` can only hold the sampled token."""
    if delta.logprobs is None:
        return None
    tokens = [token_text(t) for t in delta.token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=delta.logprobs,
        top_logprobs=[{t: lp} for t, lp in zip(tokens, delta.logprobs, strict=True)] if with_top else None,
        text_offset=offsets,
    )


def chat_logprobs(delta: Delta, token_text: TokenText, with_top: bool) -> ChatLogprobs | None:
    if delta.logprobs is None:
        return None
    content = []
    for token_id, logprob in zip(delta.token_ids, delta.logprobs, strict=True):
        token = token_text(token_id)
        entry = {"token": token, "logprob": logprob, "bytes": list(token.encode())}
        top = [entry] if with_top else []
        content.append(ChatTokenLogprob(**entry, top_logprobs=top))
    return ChatLogprobs(content=content)


# ---- the two APIs' output shapes -----------------------------------------------------


class OutputFormat(Protocol):
    """How one API shapes engine outputs: stream chunks, and the one-shot response."""

    def head_chunks(self) -> list[BaseModel]: ...

    def chunk(self, index: int, delta: Delta, finish: str | None) -> BaseModel: ...

    def usage_chunk(self, usage: UsageInfo) -> BaseModel: ...

    def response(self, outputs: list[RequestOutput]) -> BaseModel: ...



class CompletionFormat:
    def __init__(self, request_id: str, model: str, token_text: TokenText, logprobs: int | None) -> None:
        self._id = request_id
        self._model = model
        self._created = int(time.time())
        self._token_text = token_text
        self._logprobs = logprobs
        self._text_offsets: dict[int, int] = defaultdict(int)

    def head_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, index: int, delta: Delta, finish: str | None) -> CompletionChunk:
        choice = CompletionChoice(
            index=index, text=delta.text, logprobs=self._logprobs_of(index, delta), finish_reason=finish
        )
        return CompletionChunk(id=self._id, created=self._created, model=self._model, choices=[choice])

    def usage_chunk(self, usage: UsageInfo) -> CompletionChunk:
        return CompletionChunk(id=self._id, created=self._created, model=self._model, choices=[], usage=usage)

    def response(self, outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for index, output in enumerate(outputs):
            delta = DeltaTracker().advance(output)
            choices.append(CompletionChoice(
                index=index, text=delta.text, logprobs=self._logprobs_of(index, delta),
                finish_reason=finish_reason(output),
            ))
        return CompletionResponse(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage_of(outputs)
        )

    def _logprobs_of(self, index: int, delta: Delta) -> CompletionLogprobs | None:
        if self._logprobs is None:
            return None
        result = completion_logprobs(delta, self._token_text, self._logprobs > 0, self._text_offsets[index])
        self._text_offsets[index] += sum(len(t) for t in result.tokens) if result else 0
        return result


class ChatFormat:
    def __init__(self, request_id: str, model: str, token_text: TokenText, top_logprobs: bool) -> None:
        self._id = request_id
        self._model = model
        self._created = int(time.time())
        self._token_text = token_text
        self._top = top_logprobs

    def head_chunks(self) -> list[BaseModel]:
        role = ChatChunkChoice(index=0, delta=DeltaMessage(role="assistant", content=""))
        return [self._chunk([role])]

    def chunk(self, index: int, delta: Delta, finish: str | None) -> ChatCompletionChunk:
        content = DeltaMessage(content=delta.text) if delta.text else DeltaMessage()
        logprobs = chat_logprobs(delta, self._token_text, self._top)
        return self._chunk([ChatChunkChoice(index=index, delta=content, logprobs=logprobs, finish_reason=finish)])

    def usage_chunk(self, usage: UsageInfo) -> ChatCompletionChunk:
        return self._chunk([], usage)

    def response(self, outputs: list[RequestOutput]) -> ChatCompletionResponse:
        output = outputs[0]
        delta = DeltaTracker().advance(output)
        choice = ChatCompletionChoice(
            index=0,
            message=ChatResponseMessage(content=delta.text),
            logprobs=chat_logprobs(delta, self._token_text, self._top),
            finish_reason=finish_reason(output),
        )
        return ChatCompletionResponse(
            id=self._id, created=self._created, model=self._model, choices=[choice], usage=usage_of(outputs)
        )

    def _chunk(self, choices: list[ChatChunkChoice], usage: UsageInfo | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
        )
