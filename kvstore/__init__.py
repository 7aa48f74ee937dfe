"""Content-addressed KV record store over the cpu, disk and redis tiers.

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
from kvstore.index import BlockLocation, StoredRecord
from kvstore.keys import ChunkKey
from kvstore.saving import SaveResult
from kvstore.spec import ChunkSpec, host_copy
from kvstore.stats import StoreSnapshot
from kvstore.store import Load, LoadPart, LoadResult, LookupResult, TieredStore

__all__ = [
    "BlockLocation",
    "ChunkKey",
    "ChunkSpec",
    "ChunkSpecError",
    "Load",
    "LoadPart",
    "LoadResult",
    "LookupResult",
    "RecordError",
    "SaveResult",
    "StoreClosedError",
    "StoreConfig",
    "StoreConfigError",
    "StoreError",
    "StoreSnapshot",
    "StoredRecord",
    "TieredStore",
    "host_copy",
]
