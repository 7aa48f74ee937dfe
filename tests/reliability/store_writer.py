"""The external writer of the concurrency scenario: writes valid records of two models
(the engines' own layout and fingerprint, and another fingerprint) under random keys into
the shared disk directory and Redis, until killed; prints the running count every REPORT_EVERY records.

    python store_writer.py '{"fingerprint": hex, "shape": [...], "dtype": "float32",
                             "chunk_tokens": n, "disk_path": ..., "disk_size": n,
                             "redis_url": ...}'
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import sys

import torch

from bench.store_io import save_tensors
from kvstore import ChunkSpec, StoreConfig, TieredStore

OTHER_MODEL = hashlib.sha256(b"another model").digest()
REPORT_EVERY = 50


def open_store(spec: dict, fingerprint: bytes) -> TieredStore:
    chunk = ChunkSpec(fingerprint, tuple(spec["shape"]), spec["dtype"], spec["chunk_tokens"])
    config = StoreConfig(kv_offload="disk,redis", kv_offload_disk_path=spec["disk_path"],
                         kv_offload_disk_size=f"{spec['disk_size']}B", kv_redis_url=spec["redis_url"])
    return TieredStore.from_config(chunk, config)


def main(spec: dict) -> None:
    stores = [open_store(spec, bytes.fromhex(spec["fingerprint"])), open_store(spec, OTHER_MODEL)]
    for count in itertools.count(1):
        store = stores[count % 2]
        payload = torch.randn(store.spec.shape).to(store.spec.dtype)
        key = store.manager.key([os.urandom(32) for _ in range(store.spec.blocks_per_chunk)])
        save_tensors(store, [key], [payload]).result(30)
        if count % REPORT_EVERY == 0:
            print(json.dumps({"written": count}), flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
