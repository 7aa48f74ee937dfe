"""The engine's KV connector, built from its options: the null connector without
--kv-offload, else a KVStoreConnector over a tiered store of the configured tiers."""

from __future__ import annotations

import torch

from connectors.base import ConnectorConfigError, KVConnector, NullConnector
from engine.config import ConfigError, EngineConfig, store_option
from engine.kv_cache_manager import cdiv

STAGING_MAX_BYTES = 1 << 30
STAGING_SLACK_CHUNKS = 8


def build_connector(config: EngineConfig, kv_cache: torch.Tensor, fingerprint: bytes) -> KVConnector:
    """`config.max_model_len` must be resolved (LLMEngine does it). A store option error
    becomes a ConfigError naming the option at fault (--kv-offload when no single one is)."""
    if not config.kv_offload:
        return NullConnector()
    from connectors.kvstore_connector import ConnectorSettings, KVStoreConnector

    settings = ConnectorSettings(
        chunk_tokens=config.kv_chunk_tokens,
        save_decode=config.kv_save_decode,
        load_timeout_s=config.kv_load_timeout,
        staging_chunks=staging_chunks(config, chunk_bytes(config, kv_cache)),
    )
    try:
        return KVStoreConnector.from_options(kv_cache, fingerprint, settings, **config.store_options())
    except ConnectorConfigError as exc:
        raise ConfigError(store_option(exc.option), str(exc)) from exc


def chunk_bytes(config: EngineConfig, kv_cache: torch.Tensor) -> int:
    return kv_cache[0].nbytes * (config.kv_chunk_tokens // config.block_size)


def staging_chunks(config: EngineConfig, nbytes: int) -> int:
    """Host staging, in chunks: one whole request of max_model_len plus slack, at most
    STAGING_MAX_BYTES. Staging is held only while a load is in flight or a copy out is
    not done, and the pool is touched up front (resident memory). A load that finds no
    free buffer loads fewer chunks; a save skips the chunk."""
    wanted = cdiv(config.max_model_len, config.kv_chunk_tokens) + 2 * STAGING_SLACK_CHUNKS
    return max(STAGING_SLACK_CHUNKS, min(wanted, STAGING_MAX_BYTES // nbytes))
