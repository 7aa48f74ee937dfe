"""GET /instance: what a router needs to know of this instance to route to it by cache
(`kvtier router`, engine/router): the model and tokenizer (to tokenize requests as this
instance does), the block hash settings (to name their blocks as this instance does), the
tiers, the shared store it loads from, and where it publishes its KV events. GET /load:
what changes from step to step, its load."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from engine.config import redact_url
from kvstore.config import REMOTE_TIERS

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine


class EventEndpoints(BaseModel):
    endpoint: str  # as bound: a wildcard host ("0.0.0.0", "*") means the instance's own host
    replay_endpoint: str | None
    topic: str


class InstanceInfo(BaseModel):
    instance_id: str  # new at every start: a router that sees it change restarts its view
    model: str  # the name responses report
    model_path: str  # the checkpoint the tokenizer is read from (this host's path)
    tokenizer: str | None  # --tokenizer, when it differs from the checkpoint
    chat_template: str | None  # the template the instance applies (--chat-template included)
    max_model_len: int
    kv_blend_separator: str | None
    tool_call_parser: str
    block_size: int
    # the chain's seed is SHA-256(b"kvtier-block-seed/v1" || fingerprint), then
    # h_i = SHA-256(h_{i-1} || tokens as LE uint32 || extra), a request's cache_salt in the
    # first block's extra (engine/hashing.py)
    fingerprint: str
    tiers: list[str]
    kv_role: str = "both"  # --kv-role: producer, consumer or both
    # the same value on every instance that loads from the same Redis and key prefix
    shared_store: str | None
    kv_events: EventEndpoints | None


class InstanceLoad(BaseModel):
    """GET /load: the instance's load as of its latest step, for a router's periodic check
    (a few numbers, where reading them from /metrics would render the whole page on the
    event loop the instance streams from). `server_load` is vLLM's /load field."""

    instance_id: str  # as in /instance: a router that sees it change reads /instance again
    server_load: int  # requests in the engine: running and waiting
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage_perc: float


def instance_load(instance_id: str, stats: Mapping[str, Any]) -> InstanceLoad:
    """The load in the engine's published `stats` (an engine that has not stepped yet: none)."""
    running = int(stats.get("num_requests_running", 0))
    waiting = int(stats.get("num_requests_waiting", 0))
    return InstanceLoad(instance_id=instance_id, server_load=running + waiting, num_requests_running=running,
                        num_requests_waiting=waiting, kv_cache_usage_perc=float(stats.get("kv_cache_usage_perc", 0.0)))


def instance_info(engine: LLMEngine, model_name: str, tool_call_parser: str) -> InstanceInfo:
    config = engine.config
    events = engine.kv_events
    shared = None
    if config.kv_redis_url and set(config.kv_offload) & set(REMOTE_TIERS):
        identity = f"{redact_url(config.kv_redis_url)} {config.kv_redis_key_prefix}"
        shared = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return InstanceInfo(
        instance_id=uuid.uuid4().hex, model=model_name, model_path=engine.model_path, tokenizer=config.tokenizer,
        chat_template=engine.tokenizer.chat_template, max_model_len=config.max_model_len,
        kv_blend_separator=config.kv_blend_separator, tool_call_parser=tool_call_parser,
        block_size=config.block_size, fingerprint=engine.fingerprint.hex, tiers=list(config.kv_offload),
        kv_role=config.kv_role, shared_store=shared,
        kv_events=None if events is None else EventEndpoints(
            endpoint=events.publisher.endpoint, replay_endpoint=events.publisher.replay_endpoint,
            topic=events.config.topic,
        ),
    )
