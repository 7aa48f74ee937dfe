"""What every route needs: the async engine, metrics, and the model facts fixed at startup."""

from __future__ import annotations

import copy
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.async_engine import AsyncEngine
from engine.builtin_models import DEFAULT_MODEL
from engine.config import EngineConfig, ServerConfig
from engine.server.body_decoder import BodyDecoder, keep_freed_memory, reserve_for
from engine.server.errors import model_not_found, too_many_prompts, too_many_sequences
from engine.server.instance_info import InstanceInfo, instance_info
from engine.server.metrics import ServerMetrics
from engine.server.prompts import PromptTokenizer

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.structured_output import GrammarCompiler

TOKEN_TEXT_CACHE = 65536


@dataclass
class ServerState:
    engine: AsyncEngine
    metrics: ServerMetrics
    settings: ServerConfig
    model_names: tuple[str, ...]
    model_root: str
    max_model_len: int
    vocab_size: int
    max_prompts_per_request: int  # --max-prompts-per-request, at most what the queue holds
    max_sequences: int  # what the queue holds: --max-num-seqs + --max-waiting-requests sequences
    kv_offload: tuple[str, ...]
    prompts: PromptTokenizer
    body_decoder: BodyDecoder
    token_text: Callable[[int], str]
    tier_health: Callable[[], dict[str, str]]  # offload tier -> "healthy"/"unhealthy", read now
    max_logprobs: int
    grammars: GrammarCompiler  # structured outputs, shared with the engine (engine/structured_output.py)
    instance: InstanceInfo  # GET /instance, for routers
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        """The name reported in responses."""
        return self.model_names[0]

    def check_model(self, requested: str | None) -> str:
        """The served name for a request's `model` field (None means the default)."""
        if requested is None or requested in self.model_names:
            return self.model_name
        raise model_not_found(requested)

    def check_prompt_count(self, count: int) -> None:
        """Refuse a completion with more prompts than one request may hold."""
        if count > self.max_prompts_per_request:
            raise too_many_prompts(count, self.max_prompts_per_request)

    def check_sequence_count(self, num_prompts: int, n: int) -> None:
        """Refuse, before any prompt is tokenized, a request whose sequences (prompts x n)
        the queue could never hold at once: it would never be admitted."""
        if num_prompts * n > self.max_sequences:
            raise too_many_sequences(num_prompts * n, num_prompts, n, self.max_sequences)


def default_model_names(model_flag: str | None) -> tuple[str, ...]:
    """What clients call the model when --served-model-name is not given."""
    return (model_flag or DEFAULT_MODEL,)


def create_state(
    config: EngineConfig, settings: ServerConfig, model_names: tuple[str, ...]
) -> ServerState:
    """Build the engine of `config` on its engine thread (see AsyncEngine: every torch op
    of the server runs there) and gather what the routes need."""
    import torch

    from engine.llm_engine import LLMEngine  # heavy (torch, transformers)

    metrics = ServerMetrics(model_names[0], config.kv_offload)
    # A server lives long: its store's host memory is faulted in before it takes traffic,
    # so that no step pays for a first touch.
    async_engine = AsyncEngine(
        lambda: LLMEngine(config, resident_host_memory=True, owns_process=True),
        max_pending_requests=settings.queue_size(config.max_num_seqs),
        observer=metrics.requests, intra_op_threads=(torch.get_num_threads, torch.set_num_threads),
    )
    engine: LLMEngine = async_engine.engine
    # The server's own tokenizer (prompts, logprob tokens): the engine's belongs to the
    # engine thread.
    tokenizer = copy.deepcopy(engine.tokenizer)
    metrics.watch(lambda: async_engine.stats)
    return ServerState(
        engine=async_engine,
        metrics=metrics,
        settings=settings,
        model_names=model_names,
        model_root=engine.model_path,
        max_model_len=engine.config.max_model_len,
        vocab_size=engine.spec.vocab_size,
        max_prompts_per_request=settings.prompt_limit(engine.config.max_num_seqs),
        max_sequences=settings.queue_size(engine.config.max_num_seqs),
        kv_offload=engine.config.kv_offload,
        prompts=PromptTokenizer(tokenizer, engine.config.max_model_len, engine.config.kv_blend_separator,
                                async_engine.lend_core),
        body_decoder=_body_decoder(async_engine, settings.max_request_bytes),
        token_text=_token_text_function(tokenizer),
        tier_health=engine.connector.tier_health,
        max_logprobs=engine.config.max_logprobs,
        grammars=engine.grammars,
        instance=instance_info(engine, model_names[0], settings.tool_call_parser),
    )


def _body_decoder(async_engine: AsyncEngine, max_request_bytes: int) -> BodyDecoder:
    """The thread that decodes big bodies, its memory kept resident where malloc allows."""
    reserve = reserve_for(max_request_bytes) if keep_freed_memory() else 0
    return BodyDecoder(async_engine.lend_core, reserve)


def _token_text_function(tokenizer: Any) -> Callable[[int], str]:
    """id -> text of one token, for logprobs (on the event loop)."""

    @functools.lru_cache(maxsize=TOKEN_TEXT_CACHE)
    def token_text(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return token_text
