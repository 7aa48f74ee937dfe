"""The connector's options: the store's (kvstore.StoreConfig) and the connector's own.

The engine's config tree includes this class as its store section, so each option here
is declared once and its name is its keyword and, with dashes, its flag.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, Field

from kvstore.config import StoreConfig
from kvstore.options import option

KV_ROLES = ("producer", "consumer", "both")
MAX_CHUNK_TOKENS = 2**24


def _kv_role(value: Any) -> Any:
    """vLLM's spelling (kv_producer, kv_consumer, kv_both) reads as kvtier's."""
    return value.removeprefix("kv_") if isinstance(value, str) else value


class ConnectorConfig(StoreConfig):
    kv_chunk_tokens: Annotated[int, Field(gt=0, le=MAX_CHUNK_TOKENS)] = option(
        256, "Tokens per stored chunk (a multiple of --block-size).")
    kv_save_decode: bool = option(False, "Also save chunks completed during decoding, not only prompt chunks.")
    kv_role: Annotated[Literal[KV_ROLES], BeforeValidator(_kv_role)] = option(
        "both", "What this instance does with the store (vLLM's roles; kv_producer etc. accepted): "
        "producer saves what it computes but never loads (a prefill instance); consumer loads but "
        "never saves (a decode instance); both. Not both implies --preemption-mode recompute.",
        metavar="{" + ",".join(KV_ROLES) + "}")

    @property
    def loads(self) -> bool:
        return self.kv_role != "producer"

    @property
    def saves(self) -> bool:
        return self.kv_role != "consumer"
