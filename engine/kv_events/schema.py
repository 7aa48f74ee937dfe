"""vLLM's KV event schema and wire format, so that a subscriber written for vLLM decodes
kvtier's events (vllm/distributed/kv_events.py).

A batch is msgpack (msgspec) of `KVEventBatch(ts, events, data_parallel_rank)`, encoded as
an array; each event is a map tagged by its class name under "type" (vLLM's encoding since
its events stopped being arrays). A ZMQ message is three frames: topic, the batch's
sequence number as 8 bytes big-endian, the payload.

Block hashes go out as vLLM sends them by default: the last 8 bytes of kvtier's 32-byte
SHA-256 block hash, big-endian, as an unsigned int (`external_hash`), which is what
a consumer compares with the hashes it computes of a prompt (the router does the same).

`medium` says where a block is: vLLM's "GPU" for the device pool (whatever the
accelerator: consumers count it as device-resident), then kvtier's tiers in vLLM's upper
case ("CPU", as vLLM's own CPU offloading says, "DISK"), and "SHARED:REDIS" for records
in a Redis every instance of a deployment loads from, announced once by the instance
that wrote them.
"""

from __future__ import annotations

from typing import Any

import msgspec

MEDIUM_DEVICE = "GPU"
SHARED_PREFIX = "SHARED:"
SHARED_TIERS = frozenset({"redis"})


def tier_medium(tier: str) -> str:
    """The `medium` of kvtier tier `tier` ("cpu" -> "CPU", "redis" -> "SHARED:REDIS")."""
    return (SHARED_PREFIX if tier in SHARED_TIERS else "") + tier.upper()


def external_hash(block_hash: bytes) -> int:
    """A block hash as vLLM publishes it by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return int.from_bytes(block_hash[-8:], "big")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change of what an instance holds."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder() -> msgspec.msgpack.Decoder[KVEventBatch]:
    return msgspec.msgpack.Decoder(KVEventBatch)
