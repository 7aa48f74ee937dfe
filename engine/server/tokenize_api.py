"""POST /tokenize and /detokenize, with vLLM's bodies and at vLLM's paths (no /v1 prefix).

Clients count and inspect tokens with them (prompt budgeting, stop-token ids, checking
a chat template's rendering). Tokenizing goes through the server's `PromptTokenizer`,
off the event loop and the engine thread, with a prompt's checks: invalid Unicode and a
prompt that leaves no room for an output token within max_model_len are 400s, as for a
completion. `--api-key` guards both routes like the /v1 ones (engine/server/auth.py).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, model_validator

from engine.server.body_decoder import BodyDecoder
from engine.server.errors import APIError
from engine.server.protocol import ChatMessage, Text
from engine.server.request_body import json_body
from engine.server.state import ServerState

router = APIRouter()


class TokenizeRequest(BaseModel):
    """vLLM's `TokenizeCompletionRequest` (`prompt`) or `TokenizeChatRequest` (`messages`,
    rendered by the chat template); `add_special_tokens` defaults to True for a prompt
    and False for messages (the template writes its own), as in vLLM."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text | None = None
    prompt: str | None = None  # checked for lone surrogates as it is tokenized (prompts.py)
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _exactly_one_source(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.messages == []:
            raise ValueError("messages must hold at least one message")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # with return_token_strs


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: Text | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _state(request: Request) -> ServerState:
    return request.app.state.kvtier


def _body_decoder(request: Request) -> BodyDecoder:
    return _state(request).body_decoder


TokenizeBody = Annotated[TokenizeRequest, Depends(json_body(TokenizeRequest, _body_decoder))]
DetokenizeBody = Annotated[DetokenizeRequest, Depends(json_body(DetokenizeRequest, _body_decoder))]


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeBody) -> TokenizeResponse:
    state = _state(request)
    state.check_model(body.model)
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await state.prompts.tokenize(body.prompt, add_special, "prompt")
    else:
        messages = [{"role": m.role, "content": m.content} for m in body.messages]
        tokens = await state.prompts.tokenize_chat(
            messages, body.add_generation_prompt, bool(body.add_special_tokens), "messages"
        )
    # the tokenizer's own string of each token (byte-level pieces such as 'Ġthe'), as vLLM's
    token_strs = state.prompts.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens, token_strs=token_strs)


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeBody) -> DetokenizeResponse:
    state = _state(request)
    state.check_model(body.model)
    bad = next((t for t in body.tokens if not 0 <= t < state.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens: token ids must be in [0, {state.vocab_size}), got {bad}",
                       param="tokens", code="invalid_value")
    return DetokenizeResponse(prompt=await state.prompts.decode(body.tokens))
