"""TieredStore end to end on real tiers: round trips, the block index (any shared run of
blocks, after a restart, from another process), failures as misses, promotion without a
copy, prefetch, pins, supervision, shutdown. Records go in and out over the engine's
path: the manager's locate and the transfers' loads and saves (bench/store_io.py)."""

from __future__ import annotations

import hashlib
import threading
import time

import pytest
import torch

from bench.store_io import load_tensors, save_tensors
from kvstore import (
    ChunkSpecError,
    StoreClosedError,
    StoreConfig,
    StoreConfigError,
    TieredStore,
    loading,
)
from kvstore.record import RecordCodec
from kvstore.spec import tensor_bytes
from tests.store.store_helpers import bits_equal, chunk_payload, make_spec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCKS = 4  # blocks per record in make_spec()


def block_hash(i: int, block: int = 0) -> bytes:
    return hashlib.sha256(f"block-{i}-{block}".encode()).digest()


def sequence(i: int, blocks: int) -> list[bytes]:
    """The block hashes of sequence `i` (stand-ins for chained hashes)."""
    return [block_hash(i, b) for b in range(blocks)]


def outputs(spec, n: int) -> list[torch.Tensor]:
    return [torch.full(spec.shape, 7, dtype=spec.dtype) for _ in range(n)]


@pytest.fixture
def open_store(tmp_path, redis_url):
    """open_store(tiers, spec=..., **options) -> a store closed after the test; disk and
    redis point at this test's directory and (emptied) shared Redis."""
    stores: list[TieredStore] = []

    def make(tiers: str, spec=None, **options) -> TieredStore:
        options.setdefault("kv_offload_disk_path", str(tmp_path / "kv"))
        options.setdefault("kv_redis_url", redis_url)
        options.setdefault("kv_offload_cpu_size", "1MiB")
        options.setdefault("kv_offload_disk_size", "16MiB")
        options.setdefault("kv_lookup_timeout", 5.0)  # the test machine may be busy
        store = TieredStore.from_config(spec or make_spec(), StoreConfig(kv_offload=tiers, **options))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def record_key(store: TieredStore, i: int):
    """The key of the full first record of sequence `i`."""
    return store.manager.key(sequence(i, BLOCKS))


def save_chunks(store: TieredStore, ids) -> list:
    keys = [record_key(store, i) for i in ids]
    result = save_tensors(store, keys, [chunk_payload(store.spec, i) for i in ids]).result(10)
    assert result.complete, result
    return keys


def save_sequence(store: TieredStore, i: int, blocks: int) -> torch.Tensor:
    """Save every record of sequence `i` (full records, then a tail); its payload."""
    hashes = sequence(i, blocks)
    payload = torch.randn(blocks, *store.spec.block_shape).to(store.spec.dtype)
    keys = [store.manager.key(hashes[s : s + BLOCKS], s) for s in range(0, blocks, BLOCKS)]
    tensors = [payload[s : s + BLOCKS].clone() for s in range(0, blocks, BLOCKS)]
    assert save_tensors(store, keys, tensors).result(10).complete
    return payload


def load_run(store: TieredStore, hashes, start: int, end: int) -> tuple[torch.Tensor, list]:
    """Locate blocks [start, end) and load what was found; (their payload, parts' tiers)."""
    load = store.transfers.open_load(store.manager.locate(hashes, start, end))
    load.wait(10)
    arrived = load.arrived_blocks()
    views = [store.transfers.view(p) for p in load.parts if p.tier is not None]
    tiers = [p.tier for p in load.parts]
    out = torch.cat(views)[:arrived].clone() if views else torch.empty(0)
    store.transfers.close_load(load)
    return out, tiers


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compress", [None, "lz4"])
def test_roundtrip_is_bit_exact_through_every_tier(open_store, tier, dtype, compress):
    store = open_store(tier, make_spec(dtype), kv_compress=compress, kv_secret="k" if compress else None)
    keys = save_chunks(store, range(3))
    assert store.manager.lookup(keys).tiers == (tier,) * 3
    outs = outputs(store.spec, 3)
    result = load_tensors(store, keys, outs).result(10)
    assert result.tiers == (tier,) * 3
    assert all(bits_equal(out, chunk_payload(store.spec, i)) for i, out in enumerate(outs))


@pytest.mark.parametrize("tiers", ["cpu", "disk", "redis", "cpu,disk"])
def test_any_shared_run_of_blocks_is_found_however_records_were_cut(open_store, tiers):
    store = open_store(tiers)
    payload = save_sequence(store, 1, 10)  # records [0..3] [4..7] and a tail [8, 9]
    hashes = sequence(1, 10)
    other = hashes[:6] + [block_hash(99, b) for b in range(6, 10)]  # shares 6 blocks
    found, _ = load_run(store, other, 1, 10)  # from block 1 (the device holds block 0)
    assert found.shape[0] == 5 and bits_equal(found, payload[1:6])
    found, _ = load_run(store, hashes, 5, 10)  # inside a record, then its tail record
    assert bits_equal(found, payload[5:10])
    assert store.manager.locate(hashes, 10, 12) == []


def test_the_index_follows_what_tiers_drop(open_store):
    spec = make_spec()
    slot = RecordCodec(spec).slot_bytes
    store = open_store("cpu,disk,redis", spec, kv_offload_cpu_size=f"{2 * slot + slot // 2}B")
    keys = [save_chunks(store, [i])[0] for i in range(6)]
    assert store.manager.lookup(keys).tiers == ("disk",) * 4 + ("cpu",) * 2
    assert store.flush(["disk"]).result(30) == {"disk": 6}
    assert store.manager.lookup(keys).tiers == ("redis",) * 4 + ("cpu",) * 2
    assert store.manager.lookup([]).num_chunks == 0
    snapshot = store.stats().counters
    assert snapshot["saves"] == 6


def test_load_reports_each_key(open_store):
    store = open_store("cpu,disk")
    keys = save_chunks(store, [0, 1, 3])
    wanted = [keys[0], keys[1], record_key(store, 2), keys[2]]
    outs = outputs(store.spec, 4)
    result = load_tensors(store, wanted, outs).result(10)
    assert result.ok == (True, True, False, True) and result.num_leading_ok == 2
    assert bits_equal(outs[3], chunk_payload(store.spec, 3))
    assert bits_equal(outs[2], torch.full(store.spec.shape, 7, dtype=store.spec.dtype))


@pytest.mark.parametrize("tiers", ["cpu,disk", "disk", "redis"])
def test_save_copies_the_callers_tensors_before_returning(open_store, tiers):
    store = open_store(tiers)
    key = record_key(store, 0)
    staging = chunk_payload(store.spec, 0).clone()
    future = save_tensors(store, [key], [staging])
    staging.fill_(0)  # the caller reuses its buffer at once
    assert future.result(10).complete
    out = outputs(store.spec, 1)
    load_tensors(store, [key], out).result(10)
    assert bits_equal(out[0], chunk_payload(store.spec, 0))


def test_a_lower_tier_load_lands_in_the_slot_that_becomes_the_cpu_copy(open_store):
    first = open_store("disk")
    payload = save_sequence(first, 2, 8)
    store = open_store("cpu,disk")
    hashes = sequence(2, 8)
    load = store.transfers.open_load(store.manager.locate(hashes, 0, 8))
    assert not load.done() or [p.tier for p in load.parts] == ["disk", "disk"]
    load.wait(10)
    slots = [p.slot for p in load.parts]
    assert bits_equal(torch.cat([store.transfers.view(p) for p in load.parts]), payload)
    store.transfers.close_load(load)
    names = [p.name for p in load.parts]
    assert [store.host.acquire(n) for n in names] == slots  # promoted in place, no copy
    assert store.stats().counters["promotions"] == 2


def test_corrupt_disk_records_are_counted_misses_and_removed(open_store):
    store = open_store("disk")
    keys = save_chunks(store, range(3))
    disk = store.lower[0]
    flipped = bytearray(disk.path(keys[0].name).read_bytes())
    flipped[-100] ^= 0xFF
    disk.path(keys[0].name).write_bytes(bytes(flipped))
    disk.path(keys[1].name).write_bytes(disk.path(keys[1].name).read_bytes()[:500])
    result = load_tensors(store, keys, outputs(store.spec, 3)).result(10)
    assert result.ok == (False, False, True)
    counters = store.stats().tiers["disk"].counters
    assert counters["checksum_failures"] == 2 and counters["misses"] == 2 and counters["hits"] == 1
    deadline = time.monotonic() + 5
    while disk.path(keys[0].name).exists() or disk.path(keys[1].name).exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert store.manager.lookup(keys[:1]).num_chunks == 0


@pytest.mark.parametrize("tiers", ["disk", "redis"])
def test_a_batch_is_read_in_concurrent_parts_and_every_bad_record_is_removed(open_store, tiers):
    store = open_store(tiers)
    keys = save_chunks(store, range(12))
    tier = store.lower[0]
    if tiers == "disk":  # a bad record in the first part and one in the last
        for key in (keys[0], keys[11]):
            flipped = bytearray(tier.path(key.name).read_bytes())
            flipped[-100] ^= 0xFF
            tier.path(key.name).write_bytes(bytes(flipped))
    in_flight = most = 0
    read = tier.get

    parts = min(12, loading.READ_THREADS)
    together = threading.Barrier(parts, timeout=10)  # broken unless every part is in flight at once
    lock = threading.Lock()

    def counted_get(names, into=None):
        nonlocal in_flight, most
        with lock:
            in_flight += 1
            most = max(most, in_flight)
        try:
            together.wait()
            return read(names, into)
        finally:
            with lock:
                in_flight -= 1

    tier.get = counted_get
    tensors = outputs(store.spec, 12)
    result = load_tensors(store, keys, tensors).result(10)
    assert most == parts > 1 and not together.broken
    bad = {0, 11} if tiers == "disk" else set()
    assert result.ok == tuple(i not in bad for i in range(12))
    assert all(bits_equal(tensors[i], chunk_payload(store.spec, i)) for i in range(12) if i not in bad)
    counters = store.stats().tiers[tiers].counters
    assert counters["checksum_failures"] == len(bad) and counters["hits"] == 12 - len(bad)
    deadline = time.monotonic() + 5
    while any(tier.holds(keys[i].name) for i in bad):
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_record_evicted_as_a_scan_reads_it_is_gone_not_bad(open_store, before_open):
    writer = open_store("disk")
    keys = save_chunks(writer, range(2))
    path = writer.lower[0].path(keys[1].name)
    before_open(path, path.unlink)  # another process evicts it once the reader listed it
    reader = open_store("disk")
    assert reader.manager.lookup(keys).num_chunks == 1
    counters = reader.stats().tiers["disk"].counters
    assert counters["checksum_failures"] == counters["rejected_records"] == counters["deletes"] == 0


def test_record_of_another_model_under_our_key_is_rejected(open_store):
    store = open_store("disk")
    key = record_key(store, 0)
    other = RecordCodec(make_spec(fingerprint=b"\x02" * 32))
    forged = other.encode(key, tensor_bytes(chunk_payload(store.spec, 0)))
    path = store.lower[0].path(key.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(forged))
    assert load_tensors(store, [key], outputs(store.spec, 1)).result(10).ok == (False,)
    assert store.stats().tiers["disk"].counters["rejected_records"] == 1


def test_other_secret_and_raw_set_are_rejected_in_redis(open_store, redis_server):
    writer = open_store("redis", kv_secret="alpha")
    reader = open_store("redis", kv_secret="beta")
    keys = save_chunks(writer, range(2))
    redis_server.client().set("kvtier:" + keys[1].name, b"raw bytes from someone else")
    assert load_tensors(reader, keys, outputs(reader.spec, 2)).result(10).ok == (False, False)
    counters = reader.stats().tiers["redis"].counters
    assert counters["auth_failures"] == 1 and counters["checksum_failures"] == 1


def test_different_models_and_chunk_sizes_never_share(open_store):
    a = open_store("redis")
    b = open_store("redis", make_spec(fingerprint=b"\x03" * 32))
    c = open_store("redis", make_spec(chunk_tokens=32))
    keys = save_chunks(a, range(2))
    for other in (b, c):
        hashes = sequence(0, 8)
        probe = other.manager.probe(hashes, 0, 8)
        assert probe.result(10) == 0 and other.manager.locate(hashes, 0, 8) == []
        assert record_key(other, 0).name != keys[0].name


def test_lower_tier_hits_are_promoted_into_cpu(open_store):
    first = open_store("disk")
    keys = save_chunks(first, range(3))
    store = open_store("cpu,disk")
    assert store.manager.lookup(keys).tiers == ("disk",) * 3
    assert load_tensors(store, keys, outputs(store.spec, 3)).result(10).tiers == ("disk",) * 3
    assert store.manager.lookup(keys).tiers == ("cpu",) * 3
    assert store.stats().counters["promotions"] == 3


def test_a_restart_indexes_the_disk_records_from_their_headers(open_store):
    first = open_store("cpu,disk")
    payload = save_sequence(first, 3, 10)
    first.close()
    again = open_store("cpu,disk")
    found, tiers = load_run(again, sequence(3, 10), 2, 10)
    assert bits_equal(found, payload[2:10]) and tiers == ["disk", "disk", "disk"]


def test_a_second_process_on_the_directory_learns_new_records_in_the_background(open_store):
    reader = open_store("disk", kv_refresh_interval=0.05)
    writer = open_store("disk")
    payload = save_sequence(writer, 4, 6)
    assert writer.drain(5)
    deadline = time.monotonic() + 10
    while len(reader.manager.locate(sequence(4, 6), 0, 6)) < 6:
        assert time.monotonic() < deadline, "the reader never learnt the writer's records"
        time.sleep(0.02)
    assert bits_equal(load_run(reader, sequence(4, 6), 0, 6)[0], payload)


def test_a_probe_of_redis_finds_another_instances_blocks(open_store):
    writer = open_store("redis")
    payload = save_sequence(writer, 5, 7)
    reader = open_store("redis")
    hashes = sequence(5, 3) + [block_hash(77, b) for b in range(3, 7)]  # shares 3 blocks
    assert reader.manager.locate(hashes, 0, 7) == []  # nothing in memory: a lookup does no I/O
    assert reader.manager.probe(hashes, 0, 7).result(10) == 3
    found, tiers = load_run(reader, hashes, 0, 7)
    assert bits_equal(found, payload[:3]) and tiers == ["redis"]
    assert reader.stats().counters["probe_hit_blocks"] == 3


def test_prefetch_pulls_records_into_cpu(open_store):
    first = open_store("disk,redis")
    save_sequence(first, 6, 8)
    store = open_store("cpu,redis")
    hashes = sequence(6, 8)
    assert store.manager.probe(hashes, 0, 8).result(10) == 8
    assert store.transfers.prefetch_run(store.manager.locate(hashes, 0, 8)).wait(10)
    assert [loc.record.tiers >= {"cpu"} for loc in store.manager.locate(hashes, 0, 8)] == [True] * 8
    assert store.transfers.prefetch_run(store.manager.locate(hashes, 0, 8)) is None  # nothing left to fetch
    assert store.stats().counters["prefetch_records"] == 2


def test_pinned_prefix_survives_heavy_traffic(open_store):
    spec = make_spec()
    store = open_store("cpu", spec, kv_offload_cpu_size=f"{4 * RecordCodec(spec).slot_bytes}B")
    pinned = [record_key(store, i) for i in range(2)]
    store.manager.pin(pinned, ttl_s=60)  # pinned before it exists, like a system prompt
    save_chunks(store, range(2))
    for i in range(100, 140):
        save_tensors(store, [record_key(store, i)], [chunk_payload(spec, i)]).result(10)
    assert store.manager.lookup(pinned).tiers == ("cpu", "cpu")
    assert store.stats().pinned_chunks == 2
    assert store.manager.unpin(pinned) == 2
    for i in range(200, 204):
        save_tensors(store, [record_key(store, i)], [chunk_payload(spec, i)]).result(10)
    assert store.manager.lookup(pinned).num_chunks == 0


def test_a_crashed_write_is_counted_and_the_writer_goes_on(open_store, monkeypatch):
    store = open_store("cpu,disk")
    disk = store.lower[0]
    real_put = disk.put
    calls = []

    def broken_once(items, blocks=None):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("injected writer bug")
        return real_put(items, blocks)

    monkeypatch.setattr(disk, "put", broken_once)
    result = save_tensors(store, [record_key(store, 0)], [chunk_payload(store.spec, 0)]).result(10)
    assert result.stored == (frozenset({"cpu"}),) and not result.complete
    assert store.stats().counters["internal_errors"] == 1
    assert save_tensors(store, [record_key(store, 1)], [chunk_payload(store.spec, 1)]).result(10).complete


def test_pending_write_budget_drops_instead_of_blocking(open_store):
    store = open_store("cpu,disk", kv_max_pending_writes=0)
    result = save_tensors(store, [record_key(store, 0)], [chunk_payload(store.spec, 0)]).result(10)
    assert result.stored == (frozenset({"cpu"}),)
    assert store.stats().counters["save_dropped_records"] == 1


def gated_disk_store(open_store, slots: int):
    """A cpu,disk store whose cpu tier has `slots` slots and whose disk writes wait for
    the returned event."""
    probe = open_store("cpu")
    store = open_store("cpu,disk", kv_offload_cpu_size=f"{slots * probe.host.slot_bytes}B")
    disk, gate = store.lower[0], threading.Event()
    real_put = disk.put

    def gated_put(items, blocks=None):
        gate.wait(10)
        return real_put(items, blocks)

    disk.put = gated_put
    return store, gate


def test_saves_beyond_the_held_slot_bound_are_deferred_then_written(open_store):
    store, gate = gated_disk_store(open_store, slots=8)  # at most 4 held by writes
    futures = [save_tensors(store, [record_key(store, i)], [chunk_payload(store.spec, i)]) for i in range(7)]
    gate.set()
    assert all(f.result(10).complete for f in futures)
    assert store.stats().counters["save_dropped_records"] == 0
    assert store.manager.lookup([record_key(store, i) for i in range(7)]).num_chunks == 7


def test_a_load_never_queues_behind_writes_stuck_in_a_tier(open_store):
    """Every write task waits on the disk: a load of a record on that disk still runs,
    on the read pool."""
    first = open_store("disk")
    save_chunks(first, [0])
    first.close()
    store, gate = gated_disk_store(open_store, slots=64)
    try:
        stuck = [save_tensors(store, [record_key(store, i)], [chunk_payload(store.spec, i)]) for i in range(1, 9)]
        out = outputs(store.spec, 1)
        result = load_tensors(store, [record_key(store, 0)], out, timeout_s=30).result()
        assert result.tiers == ("disk",) and bits_equal(out[0], chunk_payload(store.spec, 0))
        assert not any(f.done() for f in stuck)  # the writes were still waiting meanwhile
    finally:
        gate.set()


def test_a_deferred_record_evicted_before_its_turn_is_dropped_and_counted(open_store):
    store, gate = gated_disk_store(open_store, slots=8)
    futures = [save_tensors(store, [record_key(store, i)], [chunk_payload(store.spec, i)]) for i in range(10)]
    # 0-3 are held by writes; 4-9 wait, unheld: saving 8 and 9 evicted 4 and 5
    gate.set()
    results = [f.result(10) for f in futures]
    assert [r.complete for r in results] == [True] * 4 + [False] * 2 + [True] * 4
    assert results[4].stored == (frozenset(),)
    assert store.stats().counters["save_dropped_records"] == 2
    disk = store.lower[0]
    assert [disk.path(record_key(store, i).name).exists() for i in range(10)] == [True] * 4 + [False] * 2 + [True] * 4


def test_close_finishes_pending_writes(open_store):
    store = open_store("disk")
    futures = [save_tensors(store, [record_key(store, i)], [chunk_payload(store.spec, i)]) for i in range(20)]
    store.close()
    assert all(f.done() and f.result().complete for f in futures)
    with pytest.raises(StoreClosedError):
        store.manager.lookup([record_key(store, 0)])
    again = open_store("disk")
    assert again.manager.lookup([record_key(again, i) for i in range(20)]).num_chunks == 20


def stuck_disk_reads(store: TieredStore) -> threading.Event:
    """Make the store's disk reads wait for the event returned (then find nothing)."""
    gate = threading.Event()

    def stuck_get(names, regions):
        gate.wait(10)
        return [None] * len(names)

    store.lower[0].get = stuck_get
    return gate


def test_a_load_of_a_record_another_load_is_reading_is_blocked_until_that_read_times_out(open_store):
    store = open_store("disk", kv_load_timeout=0.5)
    save_chunks(store, [0])
    gate = stuck_disk_reads(store)
    hashes = sequence(0, BLOCKS)
    try:
        first = store.transfers.open_load(store.manager.locate(hashes, 0, BLOCKS))
        assert first.num_blocks == BLOCKS and not first.blocked
        second = store.transfers.open_load(store.manager.locate(hashes, 0, BLOCKS))  # the record's slot is the first load's
        assert second.num_blocks == 0 and second.blocked
        assert first.wait(5)  # timed out: not worth waiting for any more
        third = store.transfers.open_load(store.manager.locate(hashes, 0, BLOCKS))
        assert third.num_blocks == 0 and not third.blocked
        for load in (first, second, third):
            store.transfers.close_load(load)
    finally:
        gate.set()


def test_close_cancels_a_load_still_reading(open_store):
    store = open_store("disk")
    save_chunks(store, [0])
    gate = stuck_disk_reads(store)
    try:
        load = store.transfers.open_load(store.manager.locate(sequence(0, BLOCKS), 0, BLOCKS))
        assert load.num_blocks == BLOCKS and not load.done()
        store.close(timeout_s=1)
        assert load.done() and load.arrived_blocks() == 0  # given up on at once
    finally:
        gate.set()


def test_close_gives_up_on_a_stuck_tier_in_bounded_time(redis_factory):
    server = redis_factory()
    store = TieredStore.from_config(make_spec(), StoreConfig(kv_offload="cpu,redis", kv_redis_url=server.url, kv_redis_op_timeout=30))
    server.pause()
    try:
        future = save_tensors(store, [record_key(store, 0)], [chunk_payload(store.spec, 0)])
        start = time.monotonic()
        store.close(timeout_s=0.3)
        assert time.monotonic() - start < 3
        assert future.done() and future.result().stored == (frozenset({"cpu"}),)
    finally:
        server.resume()


def wait_for_health(store: TieredStore, tier: str, state: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while store.stats().tiers[tier].health != state:
        assert time.monotonic() < deadline, f"{tier} never became {state}"
        time.sleep(0.02)


def redis_only_store(server, spec) -> TieredStore:
    """A store on `server` alone, with short timeouts and a fast probe (outage tests)."""
    config = StoreConfig(kv_offload="redis", kv_redis_url=server.url, kv_redis_op_timeout=0.5,
                         kv_redis_probe_interval=0.05)
    return TieredStore.from_config(spec, config)


def test_redis_outage_is_misses_then_recovery(redis_factory):
    server = redis_factory()
    spec = make_spec()
    store = redis_only_store(server, spec)
    try:
        keys = save_chunks(store, range(2))
        server.kill()
        start = time.monotonic()
        assert load_tensors(store, keys, outputs(spec, 2)).result(5).ok == (False, False)
        assert not save_tensors(store, [record_key(store, 2)], [chunk_payload(spec, 2)]).result(5).complete
        assert time.monotonic() - start < 2
        assert store.stats().tiers["redis"].health == "unhealthy"
        server.start()
        wait_for_health(store, "redis", "healthy")
        save_chunks(store, range(2))
        assert store.manager.lookup(keys).num_chunks == 2
    finally:
        store.close()


def test_after_an_outage_records_the_index_knew_in_redis_are_saved_again(redis_factory):
    """Redis came back empty: the index must not go on believing it holds the records
    of before, or saving them again would skip Redis."""
    server = redis_factory()
    spec = make_spec()
    store = redis_only_store(server, spec)
    try:
        keys = save_chunks(store, range(3))
        assert store.manager.lookup(keys).num_chunks == 3
        server.kill()
        wait_for_health(store, "redis", "unhealthy")
        server.start()  # empty
        wait_for_health(store, "redis", "healthy")
        assert store.manager.lookup(keys).num_chunks == 0
        save_chunks(store, range(3))
        assert len(list(server.client().scan_iter("kvtier:*"))) == 3
        assert load_tensors(store, keys, outputs(spec, 3)).result(5).ok == (True, True, True)
    finally:
        store.close()


def test_a_redis_restarted_between_two_probes_is_an_outage_though_no_operation_failed(redis_factory):
    """Killed and started again between two probes, Redis never looked unhealthy; the
    probe that finds another Redis process must still make the index forget it."""
    server = redis_factory()
    spec = make_spec()
    store = TieredStore.from_config(spec, StoreConfig(kv_offload="redis", kv_redis_url=server.url, kv_redis_probe_interval=3600))
    (redis,) = store.lower
    try:
        keys = save_chunks(store, range(3))
        assert redis.probe()
        server.kill()
        server.start()  # empty
        assert redis.probe()
        assert redis.health.last_error is None  # nothing failed: only the process changed
        assert store.manager.lookup(keys).num_chunks == 0
        save_chunks(store, range(3))
        assert len(list(server.client().scan_iter("kvtier:*"))) == 3
    finally:
        store.close()


def test_a_probe_of_a_stalled_redis_is_bounded_and_lookups_stay_in_memory(redis_factory):
    server = redis_factory()
    store = TieredStore.from_config(make_spec(), StoreConfig(kv_offload="cpu,redis", kv_redis_url=server.url, kv_lookup_timeout=0.2))
    try:
        save_sequence(store, 8, 4)
        server.pause()
        start = time.monotonic()
        assert len(store.manager.locate(sequence(8, 4), 0, 4)) == 4
        assert store.manager.probe(sequence(9, 4), 0, 4).result(5) == 0
        assert time.monotonic() - start < 1.5
    finally:
        server.resume()
        store.close()


def test_load_timeout_always_resolves(redis_factory):
    server = redis_factory()
    spec = make_spec()
    store = TieredStore.from_config(spec, StoreConfig(kv_offload="redis", kv_redis_url=server.url, kv_redis_op_timeout=30))
    try:
        keys = save_chunks(store, range(2))
        server.pause()
        start = time.monotonic()
        result = load_tensors(store, keys, outputs(spec, 2), timeout_s=0.3).result(5)
        assert result.ok == (False, False) and time.monotonic() - start < 2
    finally:
        server.resume()
        store.close()


def test_cluster_store_roundtrip_and_block_index(redis_cluster):
    spec = make_spec(torch.bfloat16)
    with TieredStore.from_config(spec, StoreConfig(kv_offload="redis", kv_redis_url=redis_cluster, kv_compress="lz4")) as store:
        keys = save_chunks(store, range(12))
        assert store.manager.lookup(keys).tiers == ("redis",) * 12
        outs = outputs(store.spec, 12)
        assert all(load_tensors(store, keys, outs).result(10).ok)
        assert all(bits_equal(o, chunk_payload(store.spec, i)) for i, o in enumerate(outs))
        with TieredStore.from_config(spec, StoreConfig(kv_offload="redis", kv_redis_url=redis_cluster)) as reader:
            assert reader.manager.probe(sequence(5, BLOCKS), 0, BLOCKS).result(10) == BLOCKS
        assert store.flush().result(30) == {"redis": 12}


def test_flush_spares_other_models(open_store):
    mine = open_store("cpu,disk")
    other = open_store("disk", make_spec(fingerprint=b"\x04" * 32))
    save_chunks(mine, range(3))
    other_keys = save_chunks(other, range(2))
    assert mine.flush().result(30) == {"cpu": 3, "disk": 3}
    assert other.manager.lookup(other_keys).num_chunks == 2


def test_stats_snapshot(open_store):
    store = open_store("cpu,disk")
    keys = save_chunks(store, range(2))
    load_tensors(store, keys, outputs(store.spec, 2)).result(10)
    store.manager.poll()
    snap = store.stats()
    cpu = snap.tiers["cpu"]
    assert cpu.counters["hits"] == 2 and cpu.hit_tokens == 2 * store.spec.chunk_tokens
    as_dict = snap.as_dict()
    assert as_dict["tiers"]["disk"]["bytes_written"] > 2 * store.spec.nbytes
    assert as_dict["tiers"]["disk"]["health"] == "healthy"
    assert as_dict["tiers"]["cpu"]["put_latency"]["count"] == 2


def test_misuse_raises_specific_errors(open_store):
    with pytest.raises(StoreConfigError):
        TieredStore.from_config(make_spec(), StoreConfig(kv_offload="cpu,tape"))
    with pytest.raises(StoreConfigError):
        TieredStore.from_config(make_spec(), StoreConfig(kv_offload="disk"))
    with pytest.raises(StoreConfigError):
        TieredStore.from_config(make_spec(), StoreConfig(kv_offload="redis"))
    with pytest.raises(StoreConfigError):
        TieredStore.from_config(make_spec(), StoreConfig(kv_offload="cpu", kv_compress="zstd"))
    with pytest.raises(StoreConfigError):
        TieredStore.from_config(make_spec(), StoreConfig(kv_offload="cpu", kv_offload_cpu_size="10B"))
    store = open_store("cpu")
    key = record_key(store, 0)
    with pytest.raises(ChunkSpecError):
        save_tensors(store, [key], [torch.zeros(3)])
    with pytest.raises(ChunkSpecError):
        load_tensors(store, [key], [torch.zeros(store.spec.shape, dtype=torch.float16)])
    with pytest.raises(StoreConfigError):
        store.manager.key([b"short"])
    with pytest.raises(StoreConfigError):
        store.manager.key(sequence(0, BLOCKS), first_block=1)
