"""Names a request's prompt blocks as an instance will: the instance's own tokenizer and
chat template through the server's own prompt code (engine/server/prompts.py, the same
rendering of messages and tools), then its block hash chain (engine/hashing.py, the
fingerprint and a request's cache_salt included), as vLLM's external hashes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine.hashing import BlockHasher
from engine.kv_events.schema import external_hash
from engine.model_files import load_tokenizer
from engine.server.errors import APIError
from engine.server.instance_info import InstanceInfo
from engine.server.prompts import PromptTokenizer
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.tool_calls import get_parser

CHAT_PATH = "/v1/chat/completions"


@dataclass(frozen=True)
class PromptBlocks:
    tokens: int  # the prompt's length
    blocks: list[int]  # its full blocks' hashes, as the instance's events name them


class RequestNamer:
    """Built once per model fingerprint (loading the tokenizer takes a moment: call it
    off the event loop)."""

    def __init__(self, info: InstanceInfo) -> None:
        tokenizer = load_tokenizer(info.model_path, info.tokenizer)
        if info.chat_template is not None:
            tokenizer.chat_template = info.chat_template
        self.block_size = info.block_size
        self._prompts = PromptTokenizer(tokenizer, info.max_model_len, info.kv_blend_separator)
        self._parser = get_parser(info.tool_call_parser)
        self._hasher = BlockHasher(bytes.fromhex(info.fingerprint), info.block_size)

    async def name(self, path: str, body: Any) -> PromptBlocks | None:
        """The (first) prompt's blocks of a request body, or None for a body the instance
        would refuse (it answers that itself)."""
        try:
            if path == CHAT_PATH:
                chat = ChatCompletionRequest.model_validate(body)
                token_ids, salt = await self._prompts.encode_chat_request(chat, self._parser), chat.cache_salt
            else:
                completion = CompletionRequest.model_validate(body)
                token_ids = (await self._prompts.encode_completion_request(completion))[0]
                salt = completion.cache_salt
        except (ValidationError, APIError, ValueError):
            return None
        hashes = self._hasher.hashes(list(token_ids), salt)
        return PromptBlocks(len(token_ids), [external_hash(h) for h in hashes])
