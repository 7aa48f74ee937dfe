"""The engine's KV connector, built from its options: the null connector without
--kv-offload, else a KVStoreConnector over a tiered store of the configured tiers."""

from __future__ import annotations

import logging

import torch

from connectors.base import ConnectorConfigError, KVConnector, NullConnector
from engine.config import ConfigError, EngineConfig, redact_url
from engine.kv_cache_manager import cdiv

logger = logging.getLogger(__name__)

STAGING_MAX_BYTES = 1 << 30
STAGING_SLACK_RECORDS = 8

PROBE_TIMEOUT_S = 5.0


def build_connector(config: EngineConfig, kv_cache: torch.Tensor, fingerprint: bytes) -> KVConnector:
    """`config.max_model_len` must be resolved (LLMEngine does it). Store option errors
    become ConfigError on the flag to blame (--kv-offload when none is). A shared tier
    that does not answer is a warning, not an error: the engine serves without it and
    the tier comes back by itself when its server does."""
    if not config.kv_offload:
        return NullConnector()
    from connectors.kvstore_connector import KVStoreConnector

    try:
        connector = KVStoreConnector.from_config(
            kv_cache, fingerprint, config, staging_size(config, chunk_bytes(config, kv_cache)))
    except ConnectorConfigError as exc:
        raise ConfigError(exc.option or "kv_offload", str(exc)) from exc
    if connector.store.probe_remote(PROBE_TIMEOUT_S):
        logger.warning(
            "the redis tier at %s does not answer: serving without it (no KV sharing) until "
            "it does; it is probed in the background and comes back by itself, /health "
            "reports it degraded and /ready answers 503 meanwhile",
            redact_url(config.kv_redis_url or ""),
        )
    return connector


def chunk_bytes(config: EngineConfig, kv_cache: torch.Tensor) -> int:
    return kv_cache[0].nbytes * (config.kv_chunk_tokens // config.block_size)


def staging_size(config: EngineConfig, nbytes: int) -> int:
    """Host slots of a store without the cpu tier, in bytes: records of one whole request
    of max_model_len plus slack, at most STAGING_MAX_BYTES (a slot holds a record's
    payload plus its header, a few KiB more). A slot is held while its load or its write
    is in flight; a load that finds none free loads fewer blocks, a save skips the record."""
    per_slot = nbytes + 8192
    wanted = cdiv(config.max_model_len, config.kv_chunk_tokens) + 2 * STAGING_SLACK_RECORDS
    return per_slot * max(STAGING_SLACK_RECORDS, min(wanted, STAGING_MAX_BYTES // per_slot))
