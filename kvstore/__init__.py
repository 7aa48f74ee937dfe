"""Content-addressed KV chunk store over the cpu, disk and redis tiers.

Entry point: `TieredStore.from_options(ChunkSpec.for_kv_layout(...), tiers="cpu,disk")`.
"""

from kvstore.config import StoreConfig
from kvstore.errors import (
    ChunkSpecError,
    RecordError,
    StoreClosedError,
    StoreConfigError,
    StoreError,
)
from kvstore.keys import ChunkKey
from kvstore.loading import LoadResult
from kvstore.saving import SaveResult
from kvstore.spec import ChunkSpec
from kvstore.stats import StoreSnapshot
from kvstore.store import LookupResult, TieredStore

__all__ = [
    "ChunkKey",
    "ChunkSpec",
    "ChunkSpecError",
    "LoadResult",
    "LookupResult",
    "RecordError",
    "SaveResult",
    "StoreClosedError",
    "StoreConfig",
    "StoreConfigError",
    "StoreError",
    "StoreSnapshot",
    "TieredStore",
]
