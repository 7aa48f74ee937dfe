"""Content-addressed KV record store: host slots (the cpu tier), disk and redis.

Entry point: `TieredStore.from_config(ChunkSpec.for_kv_layout(...), StoreConfig(kv_offload="cpu,disk", ...))`,
whose `manager` (kvstore.manager) answers the scheduler from memory and whose
`transfers` (kvstore.transfers) move the bytes.

The names below are imported on first use: `kvstore.config` (which the CLI's option
checks need) must not pull in torch through the store, so that a bad flag is reported
before any heavy import.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlockLocation": "kvstore.index",
    "ChunkKey": "kvstore.keys",
    "ChunkSpec": "kvstore.spec",
    "ChunkSpecError": "kvstore.errors",
    "Load": "kvstore.transfers",
    "LoadPart": "kvstore.manager",
    "LoadPlan": "kvstore.manager",
    "LookupResult": "kvstore.manager",
    "RecordError": "kvstore.errors",
    "SaveResult": "kvstore.saving",
    "StoreClosedError": "kvstore.errors",
    "StoreConfig": "kvstore.config",
    "StoreConfigError": "kvstore.errors",
    "StoreError": "kvstore.errors",
    "StoreSnapshot": "kvstore.stats",
    "StoreManager": "kvstore.manager",
    "StoredRecord": "kvstore.index",
    "TieredStore": "kvstore.store",
    "Transfers": "kvstore.transfers",
    "host_copy": "kvstore.spec",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
