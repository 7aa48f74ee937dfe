"""The pieces of a `TieredStore` that its loader and its write-behind both work with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.buffers import BufferPool
from kvstore.record import RecordCodec
from kvstore.runtime import IoRuntime
from kvstore.stats import StoreCounters
from tiers.base import RecordTier
from tiers.cpu import CpuTier


@dataclass(frozen=True)
class StoreParts:
    codec: RecordCodec
    cpu: CpuTier | None
    lower: Sequence[RecordTier]  # the record tiers, in lookup order (disk, then redis)
    runtime: IoRuntime  # the I/O loop the coroutines run on
    counters: StoreCounters  # the store's own counters (tiers count in theirs)
    buffers: BufferPool  # record-sized buffers, reused across loads and saves
