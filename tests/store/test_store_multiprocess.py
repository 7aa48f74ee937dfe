"""Several real processes on one disk directory and one Redis: no torn record is ever read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.store_io import load_tensors
from kvstore import StoreConfig, TieredStore
from tests.store.store_helpers import bits_equal, chunk_payload, make_spec

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
WORKER = HERE / "mp_worker.py"


def spawn(mode: str, options: dict) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    return subprocess.Popen(
        [sys.executable, str(WORKER), mode, json.dumps(options)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def summary_of(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_two_processes_share_disk_and_redis_without_torn_reads(tmp_path, redis_url):
    chunk = make_spec(torch.bfloat16, chunk_tokens=64).nbytes
    options = {
        "kv_offload_disk_path": str(tmp_path / "kv"),
        "kv_redis_url": redis_url,
        "kv_offload_disk_size": f"{5 * chunk}B",
        "ids": 8,
        "seconds": 2.0,
    }  # small budget: they evict each other
    procs = [spawn("churn", {**options, "seed": seed}) for seed in (1, 2)]
    for summary in [summary_of(p) for p in procs]:
        for tier in ("disk", "redis"):
            counts = summary[tier]
            assert counts["loads"] > 50 and counts["hits"] > 10, summary
            assert counts["mismatches"] == counts["checksum_failures"] == 0, summary
            assert counts["rejected_records"] == counts["errors"] == 0, summary
    assert not list((tmp_path / "kv").rglob("*.tmp"))


def test_sigkill_during_writes_leaves_no_torn_record(tmp_path):
    path = tmp_path / "kv"
    writer = spawn("writer", {"kv_offload": "disk", "kv_offload_disk_path": str(path), "chunk_tokens": 1024})
    try:
        assert writer.stdout.readline().strip() == "ready"
        time.sleep(0.3)
    finally:
        writer.kill()
        writer.wait(10)
    spec = make_spec(torch.bfloat16, chunk_tokens=1024)
    store = TieredStore.from_config(spec, StoreConfig(kv_offload="disk", kv_offload_disk_path=str(path), kv_offload_disk_size="1GiB"))
    try:
        assert not list(path.rglob("*.tmp"))  # the dead writer's temp files were removed
        from mp_worker import record_key

        keys = [record_key(store, i) for i in range(10_000)]
        found = store.manager.lookup(keys).num_chunks
        assert found >= 4
        outs = [torch.empty(spec.shape, dtype=spec.dtype) for _ in range(found)]
        assert all(load_tensors(store, keys[:found], outs).result(30).ok)
        assert all(bits_equal(out, chunk_payload(spec, i)) for i, out in enumerate(outs))
        assert store.stats().tiers["disk"].counters["checksum_failures"] == 0
    finally:
        store.close()
