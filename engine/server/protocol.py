"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are validated strictly (no string-to-number coercion, as OpenAI does) and
unknown fields are ignored. Fields OpenAI defines but the engine cannot honour are
accepted only at their neutral value, so a client never silently gets other semantics.
Every string must be valid Unicode: JSON can spell a lone UTF-16 surrogate (`"\\ud800"`),
which no tokenizer and no UTF-8 encoder accepts, so it is refused here (`Text`), except
in the texts of a completion's `prompt` and `segments`: those are checked by the server's
tokenizer (engine/server/prompts.py), as far as it reads them, since a huge prompt is
refused from its first characters.

JSON has no NaN or infinity: response bodies are rendered with pydantic's JSON encoder
(`responses.json_response`, `responses.sse`), which writes a non-finite float (such as a
logprob) as `null`.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from engine.blend.segments import MAX_SEGMENTS
from engine.logprobs import PromptLogprobs

MAX_SEED = 2**63 - 1
MAX_STOP_STRINGS = 16
MAX_N = 128  # OpenAI's bound on completions per prompt
MAX_SEPARATOR_CHARS = 64

# A prompt after validation: one entry per prompt, each text or token ids.
Prompts = list[str | list[int]]


def check_unicode(text: str) -> str:
    """`text`, if it holds no lone UTF-16 surrogate (which no UTF-8 encoder takes). Strict
    UTF-16 encoding rejects exactly those, in about 60% of the time UTF-8's takes (7 against
    12 ms for 8 MB of text), and an ASCII string cannot hold one."""
    if text.isascii():
        return text
    try:
        text.encode("utf-16-le")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains a lone UTF-16 surrogate (U+{ord(text[exc.start]):04X} at character {exc.start}), "
            "which is not valid Unicode"
        ) from None
    return text


Text = Annotated[str, AfterValidator(check_unicode)]


def _is_token_list(value: Any) -> bool:
    """A list of non-negative ints, maybe empty (bools are not token ids). Checked in C
    (`map`, `set`, `min`): a long prompt's ids are thousands of items."""
    return isinstance(value, list) and (not value or (set(map(type, value)) == {int} and min(value) >= 0))


def parse_prompt(value: Any) -> Prompts:
    """A string, a list of strings, a list of token ids, or a list of token-id lists
    (texts unchecked for lone surrogates: see the module docstring)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if _is_token_list(value):
            return [value]
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(_is_token_list(p) and p for p in value):
            return list(value)
    raise ValueError(
        "must be a string, a non-empty list of strings, a list of non-negative token ids, "
        "or a list of non-empty token-id lists"
    )


def parse_segments(value: Any) -> list[str | list[int]]:
    """A prompt's segments: a list of texts, or a list of token-id lists (texts unchecked
    for lone surrogates: see the module docstring)."""
    kinds_ok = isinstance(value, list) and (
        all(isinstance(s, str) for s in value) or all(_is_token_list(s) for s in value))
    if kinds_ok and 0 < len(value) <= MAX_SEGMENTS:
        return list(value)
    raise ValueError(
        f"must be a list of 1 to {MAX_SEGMENTS} strings, or of as many lists of non-negative token ids"
    )


def parse_prefix(value: Any) -> str | list[int] | None:
    """A prefix to pin: a string or a list of non-negative token ids."""
    if value is None or isinstance(value, str):
        return value if value is None else check_unicode(value)
    if _is_token_list(value):
        return value
    raise ValueError("must be a string or a list of non-negative token ids")


def parse_stop(value: Any) -> list[str]:
    if value is None:
        return []
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise ValueError("must be a non-empty string or a list of non-empty strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
    return [check_unicode(s) for s in stops]


def parse_content(value: Any) -> str:
    """Message content: a string, or a list of text parts (joined)."""
    if isinstance(value, str):
        return check_unicode(value)
    if isinstance(value, list):
        texts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(value) and all(isinstance(t, str) for t in texts):
            return check_unicode("".join(texts))
    raise ValueError('must be a string or a list of {"type": "text", "text": ...} parts')


def parse_content_or_none(value: Any) -> str | None:
    return None if value is None else parse_content(value)


def _choice_text(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"


def only_neutral(*neutral: Any) -> classmethod:
    """A validator accepting a field the engine cannot honour only at a neutral value."""

    def check(cls: type, value: Any) -> Any:
        if not any(type(value) is type(n) and value == n for n in neutral):
            raise ValueError("is not supported by this server (leave it unset)")
        return value

    return classmethod(check)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class FunctionCall(_Strict):
    name: FunctionName
    arguments: Text  # a JSON object's text


class ToolCallItem(_Strict):
    """A call the assistant made, in a message of the history or of a response."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # None only in an assistant message that made tool calls
    content: Annotated[str | None, BeforeValidator(parse_content_or_none)] = None
    name: Text | None = None
    tool_calls: list[ToolCallItem] | None = None  # assistant messages
    tool_call_id: Text | None = None  # tool messages: the call answered

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        return self

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it (content always a string)."""
        message: dict[str, Any] = {"role": self.role, "content": self.content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    name: Text = "response"
    description: Text | None = None
    json_schema: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError('type "json_schema" needs a json_schema object')
        return self


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` extra: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: Text | None = None
    choice: list[Text] | None = None
    grammar: Text | None = None

    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)


class _SamplingRequest(_Strict):
    """Fields shared by completions and chat completions."""

    model: Text | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)  # -1 (vLLM) and 0 both disable top-k
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: Annotated[list[str], BeforeValidator(parse_stop)] = Field(default_factory=list)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    n: int = Field(1, ge=1, le=MAX_N)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: Text | None = Field(None, min_length=1, max_length=1024)
    # marks segment boundaries in the prompt text: the request is blended (engine/blend)
    kv_blend_separator: Text | None = Field(None, min_length=1, max_length=MAX_SEPARATOR_CHARS)
    user: Text | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # what the output must match: OpenAI's response_format, vLLM's structured_outputs and
    # its older guided_* extras (at most one of them; engine/server/structured.py reads them)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # vLLM's extra: each prompt token's logprob and the k most likely at its position
    prompt_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (checked by the engine)
    # vLLM's prefill/decode disaggregation: {"do_remote_decode": true} on the prefill
    # instance's request holds the answer until the prompt's KV is in the shared tier
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def hands_over_kv(self) -> bool:
        return bool((self.kv_transfer_params or {}).get("do_remote_decode"))

    _no_penalties = field_validator("frequency_penalty", "presence_penalty")(only_neutral(0.0))
    _no_logit_bias = field_validator("logit_bias")(only_neutral(None, {}))

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("is only allowed when stream is true")
        return value

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, value: int | None, info: ValidationInfo) -> int | None:
        """As vLLM: prompt logprobs come in the response body, which a stream has not."""
        if value is not None and info.data.get("stream"):
            raise ValueError("is not available when stream is true")
        return value

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: Annotated[Prompts, BeforeValidator(parse_prompt)] | None = None
    # the prompt as its segments (system prompt, documents, question), instead of `prompt`
    segments: Annotated[list[str | list[int]], BeforeValidator(parse_segments)] | None = None
    max_tokens: int | None = Field(None, ge=1)  # unset: 16, as OpenAI (less if the context is shorter)
    logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (checked in serving)
    echo: bool = False
    best_of: int | None = None
    suffix: Text | None = None

    _no_best_of = field_validator("best_of")(only_neutral(None, 1))
    _no_suffix = field_validator("suffix")(only_neutral(None, ""))

    @model_validator(mode="before")
    @classmethod
    def _prompt_required(cls, data: Any) -> Any:
        """Without segments, `prompt` is a required field (and reported as one)."""
        if isinstance(data, dict) and data.get("prompt") is None and data.get("segments") is None:
            raise ValidationError.from_exception_data(cls.__name__, [{"type": "missing", "loc": ("prompt",), "input": data}])
        return data

    @model_validator(mode="after")
    def _prompt_or_segments(self) -> CompletionRequest:
        if self.prompt is not None and self.segments is not None:
            raise ValueError("give exactly one of prompt or segments")
        return self

    @property
    def num_prompts(self) -> int:
        """How many engine requests the body asks for (segments make one prompt)."""
        return 1 if self.prompt is None else len(self.prompt)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (checked in serving)
    tools: list[ToolDefinition] | None = None
    # default: "auto" when tools are given, else "none"
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools") or []
        forcing = choice in ("auto", "required") or isinstance(choice, NamedToolChoice)
        if forcing and not tools:
            raise ValueError(f"{_choice_text(choice)} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name for t in tools}:
            raise ValueError(f"names the function {choice.function.name!r}, which tools do not list")
        return choice

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    @property
    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown (none with tool_choice "none")."""
        if self.effective_tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools or []]

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("is only allowed when logprobs is true")
        return value

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---- responses ------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # None for an echoed first prompt token (nothing predicts it), as OpenAI
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, with `prompt_logprobs`


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[dict[str, Any]] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallItem] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extra, with `prompt_logprobs`


class SparseDelta(BaseModel):
    """A streamed piece that carries only what changed, as OpenAI sends it: unset fields
    are left out rather than sent as null."""

    @model_serializer(mode="wrap")
    def _omit_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(SparseDelta):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(SparseDelta):
    """A piece of streamed tool call `index`: its first piece carries its id, type and name
    (and arguments ""), the pieces after it more of the arguments' JSON text."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(SparseDelta):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvtier"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- KV admin -------------------------------------------------------------------------------

MAX_PIN_TTL_S = 30 * 24 * 3600.0


class PinRequest(_Strict):
    """A prefix to pin or unpin: a prompt (text or token ids) or a chat message list."""

    model: Text | None = None
    prompt: Annotated[str | list[int] | None, BeforeValidator(parse_prefix)] = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    ttl: float | None = Field(3600.0, gt=0.0, le=MAX_PIN_TTL_S)  # seconds; null: until unpinned
    cache_salt: Text | None = Field(None, min_length=1, max_length=1024)

    @model_validator(mode="after")
    def _exactly_one_source(self) -> PinRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.prompt is not None and len(self.prompt) == 0:
            raise ValueError("the prompt is empty")
        return self


class FlushRequest(_Strict):
    tiers: list[Literal["cpu", "disk", "redis"]] | None = Field(
        None, description="tiers to flush; null flushes every tier"
    )
