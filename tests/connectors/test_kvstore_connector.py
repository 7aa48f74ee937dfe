"""KVStoreConnector on a real TieredStore, driven the way the scheduler and model runner
drive it, over a small device cache filled with known values (no model)."""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

import pytest
import torch

from connectors import KVStoreNotConfiguredError, NullConnector
from connectors.config import ConnectorConfig
from connectors.kvstore_connector import KVStoreConnector
from engine.hashing import BlockHasher
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from kvstore.config import STAGING_SIZE

BS, CHUNK, NUM_BLOCKS = 4, 8, 40  # 2 blocks per chunk
FINGERPRINT = hashlib.sha256(b"connector-test-model").digest()
HASHER = BlockHasher(FINGERPRINT, BS)


def make_cache() -> torch.Tensor:
    """Block b holds the value b everywhere: a copied block shows where it came from."""
    cache = torch.empty(NUM_BLOCKS, 2, 2, BS, 2, 8)
    for block in range(NUM_BLOCKS):
        cache[block] = float(block)
    return cache


def make_connector(
    cache: torch.Tensor, tmp_path: Path, tiers: str = "cpu", staging_size: int = STAGING_SIZE, **options
) -> KVStoreConnector:
    options.setdefault("kv_offload_cpu_size", "1MiB")
    config = ConnectorConfig(kv_chunk_tokens=CHUNK, kv_offload=tiers, kv_offload_disk_path=str(tmp_path / "disk"),
                             **options)
    return KVStoreConnector.from_config(cache, FINGERPRINT, config, staging_size)


def make_request(request_id: str, num_tokens: int, salt: str | None = None, first: int = 10) -> Request:
    request = Request(request_id, list(range(first, first + num_tokens)), SamplingParams(max_tokens=4), cache_salt=salt)
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
    """Admission as the scheduler does it (asking again while the answer is pending)."""
    while True:
        num_external, is_async = connector.get_num_new_matched_tokens(request, device_hit)
        if num_external is not None:
            break
        connector.wait_for_loads(1)
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


def wait_for_load(connector: KVStoreConnector, request_id: str) -> int:
    """Until the request's asynchronous load is done; the tokens it delivered."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        loaded = connector.get_finished()
        if request_id in loaded:
            return loaded[request_id]
        connector.wait_for_loads(0.1)
    raise AssertionError("the load never finished")


def compute_and_save(connector: KVStoreConnector, request: Request, table: list[int]) -> None:
    admit(connector, request, 0, table)
    run_step(connector, [request], [table])
    assert connector.store.drain(5)


@pytest.fixture
def cache() -> torch.Tensor:
    return make_cache()


def test_saves_prompt_records_then_loads_them_into_other_blocks(cache, tmp_path):
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
    assert connector.store.host.slots_in_use == 0
    connector.close()


def test_device_hit_inside_a_record_writes_only_the_missing_blocks(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    request = make_request("b", 21)
    table = [20, 21, 22, 23, 24, 25]  # block 20 is the device hit (one block)
    assert admit(connector, request, BS, table) == (16, False)
    run_step(connector, [], [])
    assert block_values(cache, table) == [20, 1, 2, 3, 4, 25]
    connector.close()


def test_a_prompt_sharing_blocks_that_end_mid_record_loads_every_shared_block(cache, tmp_path):
    # "a" has 9 full blocks: records [0,1] [2,3] [4,5] [6,7] and a tail [8]. "b" shares
    # its first 7 blocks (28 tokens), then differs: it ends mid-record [6,7].
    connector = make_connector(cache, tmp_path)
    a = make_request("a", 37)
    compute_and_save(connector, a, list(range(10)))
    b = Request("b", a.prompt_token_ids[:28] + [999] * 9, SamplingParams(max_tokens=4))
    HASHER.extend(b.block_hashes, b.prompt_token_ids, None)
    table = list(range(20, 30))
    assert admit(connector, b, 0, table) == (28, False)
    run_step(connector, [b], [table])
    assert block_values(cache, table[:7]) == [0, 1, 2, 3, 4, 5, 6]
    # b's own records: [0..5] are a's; [6,7] and the tail [8] differ and are saved
    assert connector.stats()["kv_saved_chunks"] == 5 + 2
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


def test_records_the_store_holds_are_not_saved_again(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    compute_and_save(connector, make_request("a", 17), [0, 1, 2, 3, 4])
    longer = make_request("b", 40)  # shares records 0 and 1, adds records 2 to 4
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
    gate = held_disk_reads(connector)  # the disk reads arrive after the abort
    request = make_request("b", 21)
    table = [30, 31, 32, 33, 34, 35]
    num_external, _ = admit(connector, request, 0, table)
    assert num_external == 20
    connector.request_finished(request, table)
    gate.set()
    run_step(connector, [], [])
    wait_until_abandoned_slots_are_free(connector)
    assert block_values(cache, table) == [30, 31, 32, 33, 34, 35]
    connector.close()


def test_async_disk_load_reports_what_arrived_and_is_copied_in_the_next_step(cache, tmp_path):
    connector = make_connector(cache, tmp_path, tiers="disk")
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    request = make_request("b", 21)
    table = [30, 31, 32, 33, 34, 35]
    promised, is_async = admit(connector, request, 0, table)
    assert promised == 20
    if is_async:  # else the file reads were done before the answer
        assert wait_for_load(connector, "b") == 20
    run_step(connector, [], [])
    assert block_values(cache, table[:5]) == [0, 1, 2, 3, 4]
    assert connector.stats()["kv_external_hit_tokens_disk"] == 20
    connector.close()


def held_disk_reads(connector: KVStoreConnector) -> threading.Event:
    """Make the store's record reads wait until the returned event is set, then read (in
    place into the device blocks, or through the slots)."""
    gate = threading.Event()
    loader = connector.store._loader
    read_from = loader._read_from

    def held_read_from(tier, ask):
        gate.wait(10)
        return read_from(tier, ask)

    loader._read_from = held_read_from
    return gate


def admitted_while_reads_are_held(
    cache: torch.Tensor, tmp_path: Path
) -> tuple[KVStoreConnector, Request, list[int], threading.Event]:
    """A disk-only connector holding a saved prompt, and request "b" for the same prompt
    admitted into blocks 30-35 with its disk reads held (set the event to release them)."""
    connector = make_connector(cache, tmp_path, tiers="disk")
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    gate = held_disk_reads(connector)
    request = make_request("b", 21)
    table = [30, 31, 32, 33, 34, 35]
    assert admit(connector, request, 0, table) == (20, True)
    return connector, request, table, gate


def wait_until_abandoned_slots_are_free(connector: KVStoreConnector) -> None:
    """Until a dropped load's reads are done and its slots given back (it reports nothing)."""
    deadline = time.monotonic() + 5
    while connector.store.host.slots_in_use and time.monotonic() < deadline:
        assert connector.get_finished() == {}
        time.sleep(0.01)
    assert connector.store.host.slots_in_use == 0, "the abandoned load's slots were never given back"


def test_records_arriving_for_an_admitted_request_are_copied_into_its_blocks_before_the_step(cache, tmp_path):
    connector, _, table, gate = admitted_while_reads_are_held(cache, tmp_path)
    gate.set()
    assert wait_for_load(connector, "b") == 20
    assert block_values(cache, table) == [0, 1, 2, 3, 4, 35]  # no step has run since
    run_step(connector, [], [])
    assert block_values(cache, table) == [0, 1, 2, 3, 4, 35]
    stats = connector.stats()
    assert stats["kv_loaded_tokens"] == stats["kv_external_hit_tokens_disk"] == 20
    assert connector.store.host.slots_in_use == 0
    connector.close()


def test_records_arriving_after_their_request_left_never_write_its_freed_blocks(cache, tmp_path):
    connector, request, table, gate = admitted_while_reads_are_held(cache, tmp_path)
    connector.request_finished(request, table)
    gate.set()
    wait_until_abandoned_slots_are_free(connector)
    assert block_values(cache, table) == [30, 31, 32, 33, 34, 35]
    connector.close()


def test_a_record_removed_behind_the_index_is_recomputed(cache, tmp_path):
    connector = make_connector(cache, tmp_path, tiers="disk")
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    disk = connector.store.lower[0]
    second = connector.store.manager.chunk_keys(make_request("x", 21).block_hashes, BS)[1]
    disk.path(second.name).unlink()  # another process removed it; the index still has it
    request = make_request("b", 21)
    promised, is_async = admit(connector, request, 0, [30, 31, 32, 33, 34, 35])
    if is_async:  # else the reads were done before the answer: it is exact already
        assert promised == 20
        promised = wait_for_load(connector, "b")
    assert promised == 8  # the blocks before the missing record
    stats = connector.stats()
    assert stats["kv_load_failures"] == 1 and stats["kv_load_failed_tokens"] == 12
    assert connector.store.manager.lookup([second]).num_chunks == 0  # forgotten in the index
    connector.close()


def test_prefetch_pulls_queued_requests_records_into_the_cpu_tier(cache, tmp_path):
    connector = make_connector(cache, tmp_path, tiers="cpu,disk")
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    assert connector.flush(["cpu"]).result(timeout=60) == {"cpu": 3}
    queued = make_request("b", 21)
    connector.prefetch([queued])
    connector.prefetch([queued])  # once per request
    assert connector.stats()["kv_prefetched_requests"] == 1
    assert admit(connector, queued, 0, list(range(10, 16))) == (20, False)
    assert connector.stats()["kv_external_hit_tokens_disk"] == 0
    connector.close()


def test_saves_are_skipped_when_every_slot_is_held(cache, tmp_path):
    record = make_connector(cache, tmp_path).store.host.slot_bytes
    connector = make_connector(cache, tmp_path, kv_offload_cpu_size=f"{2 * record}B")
    pinned = make_request("p", 17, first=500)  # 2 full records, pinned: they never leave
    connector.pin(pinned.block_hashes, ttl_s=None)
    compute_and_save(connector, pinned, [0, 1, 2, 3, 4])
    compute_and_save(connector, make_request("a", 21), [5, 6, 7, 8, 9, 10])
    stats = connector.stats()
    assert (stats["kv_saved_chunks"], stats["kv_save_skipped_chunks"]) == (2, 3)
    connector.close()


def test_a_load_stops_at_the_records_that_get_a_slot(cache, tmp_path):
    record = make_connector(cache, tmp_path).store.host.slot_bytes
    compute_and_save(make_connector(cache, tmp_path, tiers="disk"), make_request("a", 21), [0, 1, 2, 3, 4, 5])
    connector = make_connector(cache, tmp_path, tiers="disk", staging_size=2 * record)
    table = list(range(10, 16))
    promised, is_async = admit(connector, make_request("b", 21), 0, table)
    assert promised == 16  # two of the three records got a slot
    if is_async:
        assert wait_for_load(connector, "b") == 16
    run_step(connector, [], [])
    assert block_values(cache, table[:4]) == [0, 1, 2, 3]
    connector.close()


def test_preemption_saves_computed_records_the_store_lacks_before_the_next_forward(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    request = make_request("a", 25)
    table = [0, 1, 2, 3, 4, 5, 6]
    admit(connector, request, 0, table)
    request.num_computed_tokens = 20  # mid-prefill: chunks 0 and 1 and block 4 are computed
    connector.request_preempted(request, table)
    meta = connector.build_meta(SchedulerOutput())
    cache[0:5] = -1.0  # the forward of the step would overwrite freed blocks ...
    cache[0:5] = torch.arange(5.0).view(5, 1, 1, 1, 1, 1)
    connector.start_load_kv(meta)  # ... but the offload copies them out first
    assert connector.stats()["kv_offloaded_chunks"] == 3  # two records and a one-block tail
    request.num_computed_tokens = 24
    connector.request_preempted(request, table)
    run_step(connector, [], [])
    assert connector.stats()["kv_offloaded_chunks"] == 4
    again = make_request("b", 25)
    other = list(range(10, 17))
    assert admit(connector, again, 0, other) == (24, False)
    run_step(connector, [], [])
    assert block_values(cache, other[:6]) == [0, 1, 2, 3, 4, 5]
    connector.close()


def test_copies_of_a_step_that_never_ran_go_with_the_next_one(cache, tmp_path):
    connector = make_connector(cache, tmp_path)
    compute_and_save(connector, make_request("a", 21), [0, 1, 2, 3, 4, 5])
    table = list(range(10, 16))
    admit(connector, make_request("b", 21), 0, table)
    connector.build_meta(SchedulerOutput())  # nothing scheduled: the engine runs no forward
    run_step(connector, [], [])
    assert block_values(cache, table[:5]) == [0, 1, 2, 3, 4]
    connector.close()


def test_pin_unpin_flush_and_tier_stats(cache, tmp_path):
    connector = make_connector(cache, tmp_path, tiers="cpu,disk")
    request = make_request("a", 21)
    compute_and_save(connector, request, [0, 1, 2, 3, 4, 5])
    # full records: a prefix's tail is its own; (chunks pinned, chunks stored)
    assert connector.pin(request.block_hashes, ttl_s=60) == (2, 2)
    assert connector.flush(None).result(timeout=60) == {"cpu": 1, "disk": 1}
    assert connector.unpin(request.block_hashes) == 2
    assert connector.flush(["cpu"]).result(timeout=60) == {"cpu": 2}
    tiers = connector.tier_stats()
    assert set(tiers) == {"cpu", "disk"}
    assert tiers["disk"]["healthy"] and tiers["disk"]["usage_bytes"] > 0
    assert tiers["cpu"]["save_latency"]["count"] == 3
    connector.close()


def test_the_null_connector_refuses_store_operations():
    null = NullConnector()
    assert null.get_num_new_matched_tokens(make_request("a", 21), 0) == (0, False)
    assert null.stats() == {} and null.get_finished() == {}
    for call in (lambda: null.pin([], None), lambda: null.unpin([]), lambda: null.flush(None), null.tier_stats):
        with pytest.raises(KVStoreNotConfiguredError):
            call()
