"""A separate process that hammers a shared store; run by test_store_multiprocess.py.

python mp_worker.py churn '{"kv_offload_disk_path": ..., "kv_redis_url": ..., "seconds": 2, ...}'
    through a disk-only and a redis-only store, saves and loads random chunks of a
    small shared id space until the deadline and checks every loaded chunk bit for
    bit; prints a JSON summary per tier.
python mp_worker.py writer '{"kv_offload_disk_path": ..., "chunk_tokens": 1024}'
    writes chunks forever (until killed); prints "ready" once some are on disk.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time

import torch

from bench.store_io import load_tensors, save_tensors
from kvstore import ChunkKey, StoreConfig, TieredStore
from tests.store.store_helpers import bits_equal, chunk_payload, make_spec


def record_key(store: TieredStore, i: int) -> ChunkKey:
    """The key of a full record named by `i` (its block hashes stand in for chained ones)."""
    blocks = store.spec.blocks_per_chunk
    return store.manager.key([hashlib.sha256(f"shared-block-{i}-{b}".encode()).digest() for b in range(blocks)])


def open_store(options: dict) -> TieredStore:
    spec = make_spec(torch.bfloat16, chunk_tokens=options.pop("chunk_tokens", 64))
    return TieredStore.from_config(spec, StoreConfig(**options))


def churn(options: dict) -> dict:
    rng = random.Random(options.pop("seed"))
    ids, seconds = options.pop("ids"), options.pop("seconds")
    stores = [open_store({**options, "kv_offload": tier}) for tier in ("disk", "redis")]
    out = torch.empty(stores[0].spec.shape, dtype=stores[0].spec.dtype)
    summary = {
        tier: {"saves": 0, "loads": 0, "hits": 0, "mismatches": 0} for tier in ("disk", "redis")
    }
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        store, i = rng.choice(stores), rng.randrange(ids)
        counts, key = summary[store.manager.tier_names[0]], record_key(store, i)
        if rng.random() < 0.5:
            save_tensors(store, [key], [chunk_payload(store.spec, i)]).result(10)
            counts["saves"] += 1
            continue
        counts["loads"] += 1
        if load_tensors(store, [key], [out]).result(10).ok[0]:
            counts["hits"] += 1
            counts["mismatches"] += not bits_equal(out, chunk_payload(store.spec, i))
    for store in stores:
        tier = store.stats().tiers[store.manager.tier_names[0]]
        for name in ("checksum_failures", "auth_failures", "rejected_records", "errors"):
            summary[tier.name][name] = tier.counters[name]
        store.close()
    return summary


def writer(options: dict) -> None:
    store = open_store(options)
    i = 0
    while True:
        save_tensors(store, [record_key(store, i)], [chunk_payload(store.spec, i)]).result(10)
        i += 1
        if i == 4:
            print("ready", flush=True)


if __name__ == "__main__":
    mode, raw = sys.argv[1], json.loads(sys.argv[2])
    if mode == "churn":
        print(json.dumps(churn(raw)), flush=True)
    else:
        writer(raw)
