"""POST /v1/completions and /v1/chat/completions: tokenize off the engine thread (after a
length check, engine/server/prompts.py), build sampling parameters, run the engine
requests, answer as one JSON body or as server-sent events. The two APIs differ only in how prompts are tokenized and how output is shaped
(`CompletionFormat`, `ChatFormat` in responses.py)."""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import TypeVar

from fastapi.responses import Response, StreamingResponse
from starlette.requests import Request

from engine.async_engine import EngineClosedError, EngineDeadError
from engine.blend.segments import Segments
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputsParams
from engine.server.errors import APIError, engine_error
from engine.server.handover import handover_tier, wait_for_handover
from engine.server.prompts import completion_prompts
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.responses import (
    DONE_EVENT,
    ChatFormat,
    CompletionFormat,
    Delta,
    DeltaTracker,
    OutputFormat,
    choices,
    error_event,
    generation_error,
    json_response,
    sse,
    usage_of,
)
from engine.server.state import ServerState
from engine.server.streams import (
    ClientDisconnectedError,
    EngineJob,
    RequestGroup,
    until_disconnected,
)
from engine.server.structured import chat_constraint, compiled, requested_constraint
from engine.tool_calls import get_parser

T = TypeVar("T")
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
CLIENT_CLOSED_REQUEST = 499


async def create_completion(state: ServerState, body: CompletionRequest, raw: Request) -> Response:
    model = state.check_model(body.model)
    state.check_sequence_count(body.num_prompts, body.n)
    _check_logprobs(state, body.logprobs, "logprobs")
    prompts, param = completion_prompts(body)
    constraint = requested_constraint(body)
    await compiled(state.grammars, constraint)
    token_lists = await _translated(state, state.prompts.encode_completion_request(body), param)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    jobs = []
    for i, token_ids in enumerate(token_lists):
        max_tokens = _max_tokens(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, len(token_ids), state.max_model_len)
        params = _sampling_params(body, max_tokens, logprobs=body.logprobs, constraint=constraint)
        jobs.append(EngineJob(f"{request_id}-{i}", token_ids, params))
    echo = await _echo_texts(state, prompts, token_lists) if body.echo else None
    fmt = CompletionFormat(request_id, model, state.token_text, body.logprobs, body.n, echo)
    return await _run(state, raw, body, jobs, fmt, param)


async def create_chat_completion(
    state: ServerState, body: ChatCompletionRequest, raw: Request
) -> Response:
    model = state.check_model(body.model)
    state.check_sequence_count(1, body.n)
    _check_logprobs(state, body.top_logprobs, "top_logprobs")
    choice = body.effective_tool_choice
    if choice == "auto" and not state.settings.enable_auto_tool_choice:
        raise APIError(400, 'tool_choice "auto" is not served here (--no-enable-auto-tool-choice); '
                       'use "none", "required" or a named function', param="tool_choice", code="invalid_value")
    parser = get_parser(state.settings.tool_call_parser)
    tools = body.offered_tools
    constraint = chat_constraint(body, tools, parser)
    await compiled(state.grammars, constraint)
    token_ids = await _translated(state, state.prompts.encode_chat_request(body, parser), "messages")
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    max_tokens = _max_tokens(body.requested_max_tokens, None, len(token_ids), state.max_model_len)
    params = _sampling_params(body, max_tokens, logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                              constraint=constraint)
    fmt = ChatFormat(request_id, model, state.token_text, body.n, tool_parser=parser if tools else None)
    return await _run(state, raw, body, [EngineJob(f"{request_id}-0", token_ids, params)], fmt, "messages")


# ---- running ------------------------------------------------------------------------------


async def _run(
    state: ServerState,
    raw: Request,
    body: CompletionRequest | ChatCompletionRequest,
    jobs: list[EngineJob],
    fmt: OutputFormat,
    prompt_param: str,
) -> Response:
    """Admit the requests (errors become 4xx/503 before any byte is sent), then answer.
    The group's requests are aborted when the client leaves or the answer is done."""
    handover = handover_tier(state, body)
    group = RequestGroup(state.engine, jobs, body.cache_salt)
    try:
        if body.stream:
            await until_disconnected(raw, _translated(state, group.start(), prompt_param))
            return StreamingResponse(
                _events(state, group, fmt, body.include_usage_in_stream, body.n),
                media_type="text/event-stream", headers=SSE_HEADERS,
            )
        outputs = await until_disconnected(raw, _translated(state, _complete(group), prompt_param))
    except ClientDisconnectedError:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    for output in outputs:
        if (error := generation_error(output)) is not None:
            raise error
    if handover is not None:
        await wait_for_handover(state, jobs, handover, body.cache_salt)
    return json_response(fmt.response(outputs))


async def _complete(group: RequestGroup) -> list[RequestOutput]:
    try:
        await group.start()
        return await group.final_outputs()
    finally:
        await group.aclose()


async def _translated(state: ServerState, work: Awaitable[T], prompt_param: str) -> T:
    """Await engine work, turning the engine's request errors into API errors."""
    try:
        return await work
    except Exception as exc:
        error = engine_error(exc, state.settings.retry_after, prompt_param)
        if error is None:
            raise
        if error.code == "queue_full":
            state.metrics.count_rejection("queue_full")
        raise error from exc


async def _events(
    state: ServerState, group: RequestGroup, fmt: OutputFormat, include_usage: bool, n: int
) -> AsyncIterator[str]:
    trackers: dict[int, DeltaTracker] = defaultdict(DeltaTracker)
    last: dict[int, RequestOutput] = {}
    try:
        for chunk in fmt.head_chunks():
            yield sse(chunk)
        failed: set[int] = set()  # a prompt whose sequences failed: its error is sent once
        async for index, output in group.outputs():
            last[index] = output
            if index in failed:
                continue
            if (error := generation_error(output)) is not None:
                failed.add(index)
                yield error_event(error)
                continue
            for choice, completion in choices([output], n):
                choice += index * n
                delta = trackers[choice].advance(completion, output)
                finish = trackers[choice].finish(completion)
                if delta.text or delta.token_ids or finish:
                    yield sse(fmt.chunk(choice, delta, finish))
        if include_usage:
            yield sse(fmt.usage_chunk(usage_of(list(last.values()))))
    except EngineClosedError:  # the server shuts down (SIGINT/SIGTERM): open choices end as aborted
        for chunk in _aborted_chunks(fmt, trackers, [c for c in range(len(group) * n) if c // n not in failed]):
            yield chunk
    except EngineDeadError as exc:  # a crash mid-stream
        yield error_event(engine_error(exc, state.settings.retry_after))
    finally:
        await group.aclose()
    yield DONE_EVENT


def _aborted_chunks(fmt: OutputFormat, trackers: dict[int, DeltaTracker], open_choices: list[int]) -> Iterator[str]:
    """The last chunk of each choice whose finish was not sent when the engine stopped:
    no new text and `finish_reason: "abort"` (vLLM's word for it), so that a client can
    tell a cut answer from a complete one."""
    for choice in open_choices:
        if trackers[choice].finish(CompletionOutput(choice, "", [], finish_reason="abort")):
            yield sse(fmt.chunk(choice, Delta("", [], None, None), "abort"))


def _check_logprobs(state: ServerState, requested: int | None, param: str) -> None:
    if requested is not None and requested > state.max_logprobs:
        raise APIError(
            400, f"{param}: at most {state.max_logprobs} (the server's --max-logprobs), got {requested}",
            param=param, code="invalid_value",
        )


def _max_tokens(requested: int | None, default: int | None, prompt_len: int, max_model_len: int) -> int:
    """The requested output length, else `default` (None: the rest of the context),
    capped to the context left after the prompt (at least one token: PromptTokenizer
    refused longer prompts). A longer request is the engine's to refuse."""
    room = max_model_len - prompt_len
    return requested or min(default or room, room)


def _prompt_logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The prompt logprobs the engine computes: those asked for, and with `echo` and
    `logprobs` those of the echoed prompt tokens (vLLM's rule)."""
    if isinstance(body, CompletionRequest) and body.echo and body.logprobs is not None:
        return max(body.prompt_logprobs or 0, body.logprobs)
    return body.prompt_logprobs


async def _echo_texts(
    state: ServerState, prompts: list[str | list[int] | Segments], token_lists: list[list[int]]
) -> list[str]:
    """Each prompt's text for `echo`: a text prompt as sent, else its tokens decoded."""
    return [
        prompt if isinstance(prompt, str) else await state.prompts.decode(list(token_ids))
        for prompt, token_ids in zip(prompts, token_lists, strict=True)
    ]


def _sampling_params(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
    constraint: tuple[StructuredOutputsParams, str] | None = None,
) -> SamplingParams:
    """`constraint`: the output constraint and the field that gave it (engine/server/structured.py)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=max(body.top_k, 0),
            min_p=body.min_p,
            seed=body.seed,
            stop=body.stop,
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=_prompt_logprobs(body),
            n=body.n,
            structured_outputs=None if constraint is None else constraint[0],
        )
    except SamplingParamsError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc
