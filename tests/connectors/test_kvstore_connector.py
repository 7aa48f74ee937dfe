"""KVStoreConnector on a real TieredStore, driven the way the scheduler and model runner
drive it, over a small device cache filled with known values (no model)."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch

from connectors import KVStoreNotConfiguredError, NullConnector
from connectors.kvstore_connector import ConnectorSettings, KVStoreConnector
from engine.hashing import BlockHasher
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput

BS, CHUNK, NUM_BLOCKS = 4, 8, 40  # 2 blocks per chunk
FINGERPRINT = hashlib.sha256(b"connector-test-model").digest()
HASHER = BlockHasher(FINGERPRINT, BS)


def make_cache() -> torch.Tensor:
    """Block b holds the value b everywhere: a copied block shows where it came from."""
    cache = torch.empty(NUM_BLOCKS, 2, 2, BS, 2, 8)
    for block in range(NUM_BLOCKS):
        cache[block] = float(block)
    return cache


def make_connector(cache: torch.Tensor, tmp_path: Path, tiers: str = "cpu", staging: int = 16,
                   **settings) -> KVStoreConnector:
    return KVStoreConnector.from_options(
        cache, FINGERPRINT, ConnectorSettings(chunk_tokens=CHUNK, staging_chunks=staging, **settings),
        tiers=tiers, cpu_size=1 << 20, disk_path=str(tmp_path / "disk"),
    )


def make_request(request_id: str, num_tokens: int, salt: str | None = None) -> Request:
    request = Request(request_id, list(range(10, 10 + num_tokens)), SamplingParams(max_tokens=4), cache_salt=salt)
    HASHER.extend(request.block_hashes, request.prompt_token_ids, salt)
    return request


def block_values(cache: torch.Tensor, block_ids: list[int]) -> list[float]:
    """The value each block holds (blocks must be uniform)."""
    values = []
    for block in block_ids:
        assert torch.all(cache[block] == cache[block].flatten()[0])
        values.append(cache[block].flatten()[0].item())
    return values


def admit(connector: KVStoreConnector, request: Request, device_hit: int, table: list[int]) -> tuple[int, bool]:
    """Admission as the scheduler does it; returns the connector's answer."""
    num_external, is_async = connector.get_num_new_matched_tokens(request, device_hit)
    connector.update_state_after_alloc(request, table, num_external)
    request.num_computed_tokens = device_hit + (0 if is_async else num_external)
    return num_external, is_async


def run_step(connector: KVStoreConnector, requests: list[Request], tables: list[list[int]]) -> None:
    """One step: its requests have computed everything they know (set here)."""
    for request in requests:
        request.num_computed_tokens = request.num_tokens
    meta = connector.build_meta(SchedulerOutput(requests=requests, block_tables=tables))
    connector.start_load_kv(meta)
    connector.wait_for_save()


def compute_and_save(connector: KVStoreConnector, request: Request, table: list[int]) -> None:
    admit(connector, request, 0, table)
    run_step(connector, [request], [table])
    assert connector.store.drain(5)


@pytest.fixture
def cache() -> torch.Tensor:
    return make_cache()


def test_saves_prompt_chunks_then_loads_them_into_other_blocks(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    first = make_request("a", 21)  # 5 full blocks: 2 full chunks and a tail of one block
    compute_and_save(connector, first, [0, 1, 2, 3, 4, 5])
    assert connector.stats()["kv_saved_chunks"] == 3

    again = make_request("b", 21)
    table = [10, 11, 12, 13, 14, 15]
    assert admit(connector, again, 0, table) == (20, False)
    run_step(connector, [], [])
    assert block_values(cache, table[:5]) == [0, 1, 2, 3, 4]
    assert block_values(cache, table[5:]) == [15]
    stats = connector.stats()
    assert stats["kv_loaded_tokens"] == stats["kv_external_hit_tokens_cpu"] == 20
    connector.close()


def test_device_hit_inside_a_chunk_writes_only_the_missing_blocks(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    request = make_request("b", 21)
    table = [20, 21, 22, 23, 24, 25]  # block 20 is the device hit (one block)
    assert admit(connector, request, BS, table) == (16, False)
    run_step(connector, [], [])
    assert block_values(cache, table) == [20, 1, 2, 3, 4, 25]
    connector.close()


def test_the_last_token_is_always_computed(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    compute_and_save(connector, make_request("a", 17), [0, 1, 2, 3, 4])
    request = make_request("b", 16)  # exactly two chunks: the last block is computed
    table = [10, 11, 12, 13]
    assert admit(connector, request, 0, table) == (12, False)
    run_step(connector, [], [])
    assert block_values(cache, table) == [0, 1, 2, 13]
    connector.close()


def test_chunks_the_store_holds_are_not_saved_again(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    compute_and_save(connector, make_request("a", 17), [0, 1, 2, 3, 4])
    longer = make_request("b", 40)  # shares chunks 0 and 1, adds chunks 2 to 4
    table = list(range(10, 20))
    assert admit(connector, longer, 0, table) == (16, False)
    run_step(connector, [longer], [table])
    assert connector.stats()["kv_saved_chunks"] == 2 + 3
    connector.close()


def test_a_different_salt_shares_nothing(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    assert admit(connector, make_request("b", 21, salt="tenant-2"), 0, list(range(10, 16))) == (0, False)
    connector.close()


@pytest.mark.parametrize("tiers", ["cpu", "disk"])
def test_an_aborted_load_never_writes_the_device_cache(cache, tmp_path, tiers):
    connector = make_connector(cache, tmp_path, tiers=tiers)
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    request = make_request("b", 21)
    table = [30, 31, 32, 33, 34, 35]
    num_external, _ = admit(connector, request, 0, table)
    assert num_external == 20
    assert not connector.request_finished(request, table)
    run_step(connector, [], [])
    deadline = time.monotonic() + 5
    while connector.transfer.pool.free_buffers < 16 and time.monotonic() < deadline:
        assert connector.get_finished() == (set(), {})
        time.sleep(0.01)
    assert connector.transfer.pool.free_buffers == 16, "the abandoned load's staging was never freed"
    assert block_values(cache, table) == [30, 31, 32, 33, 34, 35]
    connector.close()


def test_async_disk_load_reports_what_arrived(cache, tmp_path):
    connector = make_connector(cache, tmp_path, tiers="disk")
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    request = make_request("b", 21)
    table = [30, 31, 32, 33, 34, 35]
    num_external, is_async = admit(connector, request, 0, table)
    loaded = {}
    while is_async and not loaded:
        connector.wait_for_loads(1)
        _, loaded = connector.get_finished()
    if not is_async:  # the file read won the race against the check
        run_step(connector, [], [])
        loaded = {"b": num_external}
    assert loaded == {"b": 20}
    assert block_values(cache, table[:5]) == [0, 1, 2, 3, 4]
    assert connector.stats()["kv_external_hit_tokens_disk"] == 20
    connector.close()


def test_prefetch_pulls_queued_requests_chunks_into_the_cpu_tier(cache, tmp_path):
    connector = make_connector(cache, tmp_path, tiers="cpu,disk")
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    assert connector.flush(["cpu"]) == {"cpu": 3}
    queued = make_request("b", 21)
    connector.prefetch([queued])
    connector.prefetch([queued])  # once per request
    assert connector.stats()["kv_prefetched_requests"] == 1
    keys = [*connector.store.chunk_keys(queued.block_hashes, BS), connector.store.key(queued.block_hashes[4])]
    deadline = time.monotonic() + 5
    while connector.store.lookup(keys).tiers != ("cpu", "cpu", "cpu"):
        assert time.monotonic() < deadline, "the prefetch never reached the cpu tier"
        time.sleep(0.01)
    assert admit(connector, queued, 0, list(range(10, 16))) == (20, False)
    connector.close()


def test_without_staging_loads_shrink_and_saves_are_skipped(cache, tmp_path):
    connector = make_connector(cache, tmp_path, staging=1)
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    stats = connector.stats()
    assert (stats["kv_saved_chunks"], stats["kv_save_skipped_chunks"]) == (1, 2)
    table = list(range(10, 16))
    assert admit(connector, make_request("b", 21), 0, table) == (8, False)
    run_step(connector, [], [])
    assert block_values(cache, table[:2]) == [0, 1]
    connector.close()


def test_preemption_saves_computed_chunks_the_store_lacks(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    request = make_request("a", 25)
    table = [0, 1, 2, 3, 4, 5, 6]
    admit(connector, request, 0, table)
    request.num_computed_tokens = 20  # mid-prefill: chunks 0 and 1 and block 4 are computed
    connector.request_preempted(request, table)
    assert connector.stats()["kv_offloaded_chunks"] == 3  # two chunks and a one-block tail
    request.num_computed_tokens = 24
    connector.request_preempted(request, table)
    assert connector.stats()["kv_offloaded_chunks"] == 4
    again = make_request("b", 25)
    assert admit(connector, again, 0, list(range(10, 17))) == (24, False)
    connector.close()


def test_pin_unpin_flush_and_tier_stats(cache, tmp_path):
    connector = make_connector(cache, tmp_path, tiers="cpu,disk")
    request = make_request("a", 21)
    compute_and_save(connector, request, [0, 1, 2, 3, 4, 5])
    assert connector.pin(request.block_hashes, ttl_s=60) == 2  # full chunks: a prefix's tail is its own
    assert connector.flush(None) == {"cpu": 1, "disk": 1}
    assert connector.unpin(request.block_hashes) == 2
    assert connector.flush(["cpu"]) == {"cpu": 2}
    tiers = connector.tier_stats()
    assert set(tiers) == {"cpu", "disk"}
    assert tiers["disk"]["healthy"] and tiers["disk"]["usage_bytes"] > 0
    assert tiers["cpu"]["save_latency"]["count"] == 3
    connector.close()


def test_the_null_connector_refuses_store_operations():
    null = NullConnector()
    assert null.get_num_new_matched_tokens(make_request("a", 21), 0) == (0, False)
    assert null.stats() == {}
    for call in (lambda: null.pin([], None), lambda: null.unpin([]), lambda: null.flush(None), null.tier_stats):
        with pytest.raises(KVStoreNotConfiguredError):
            call()
