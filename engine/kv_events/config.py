"""`--kv-events-config`: vLLM's KVEventsConfig, the same JSON keys and defaults
(vllm/config/kv_events.py), so a vLLM command line's value works unchanged."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class KVEventsConfig(BaseModel):
    """Where and how the instance publishes its KV events (ZMQ PUB, plus a ROUTER that
    replays the last `buffer_steps` batches to a subscriber that missed some)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: zmq when enabled, else null
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: Annotated[int, Field(ge=1, le=2**24)] = 10_000
    hwm: Annotated[int, Field(ge=0, le=2**31 - 1)] = 100_000
    max_queue_size: Annotated[int, Field(ge=1, le=2**31 - 1)] = 100_000
    topic: str = ""

    @property
    def publishes(self) -> bool:
        """Whether events go out at all (vLLM's publisher default follows the switch)."""
        publisher = self.publisher or ("zmq" if self.enable_kv_cache_events else "null")
        return self.enable_kv_cache_events and publisher == "zmq"


def parse_kv_events_config(value: Any) -> KVEventsConfig | None:
    """A JSON object (text, as the flag takes it, or a mapping from a config file or
    `LLM(...)`) as a KVEventsConfig; ValueError naming the key at fault."""
    if value is None or isinstance(value, KVEventsConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON ({exc.msg} at character {exc.pos}); give an object such as "
                             '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object of vLLM's KVEventsConfig keys, got {type(value).__name__}")
    try:
        return KVEventsConfig(**value)
    except ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in error["loc"]) or "value"
        message = error["msg"] if error["type"] != "extra_forbidden" else "is not a KVEventsConfig key"
        raise ValueError(f"{key}: {message}") from None
