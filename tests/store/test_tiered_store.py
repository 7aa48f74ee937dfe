"""TieredStore end to end on real tiers: round trips, lookup runs, failures as misses,
promotion, prefetch, pins, supervision, shutdown."""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

from kvstore import (
    ChunkSpecError,
    StoreClosedError,
    StoreConfigError,
    TieredStore,
)
from kvstore.record import HEADER_SIZE, RecordCodec
from kvstore.spec import tensor_bytes
from tests.store.store_helpers import bits_equal, chunk_payload, make_spec

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block-{i}".encode()).digest()


def outputs(spec, n: int) -> list[torch.Tensor]:
    return [torch.full(spec.shape, 7, dtype=spec.dtype) for _ in range(n)]


@pytest.fixture
def open_store(tmp_path, redis_url):
    """open_store(tiers, spec=..., **options) -> a store closed after the test; disk and
    redis point at this test's directory and (emptied) shared Redis."""
    stores: list[TieredStore] = []

    def make(tiers: str, spec=None, **options) -> TieredStore:
        options.setdefault("disk_path", str(tmp_path / "kv"))
        options.setdefault("redis_url", redis_url)
        options.setdefault("cpu_size", 1 << 20)
        options.setdefault("disk_size", 1 << 24)
        options.setdefault("lookup_timeout_s", 5.0)  # the test machine may be busy
        store = TieredStore.from_options(spec or make_spec(), tiers=tiers, **options)
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def save_chunks(store: TieredStore, ids) -> list:
    keys = [store.key(block_hash(i)) for i in ids]
    result = store.save(keys, [chunk_payload(store.spec, i) for i in ids]).result(10)
    assert result.complete, result
    return keys


@pytest.mark.parametrize("tier", ["cpu", "disk", "redis"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("compress", [None, "lz4"])
def test_roundtrip_is_bit_exact_through_every_tier(open_store, tier, dtype, compress):
    store = open_store(tier, make_spec(dtype), compress=compress, secret="k" if compress else None)
    keys = save_chunks(store, range(3))
    assert store.lookup(keys).tiers == (tier,) * 3
    outs = outputs(store.spec, 3)
    result = store.load(keys, outs).result(10)
    assert result.tiers == (tier,) * 3
    assert all(bits_equal(out, chunk_payload(store.spec, i)) for i, out in enumerate(outs))


def test_lookup_is_a_prefix_run_across_tiers(open_store):
    spec = make_spec()
    store = open_store("cpu,disk,redis", spec, cpu_size=2 * spec.nbytes)
    keys = [save_chunks(store, [i])[0] for i in range(6)]
    assert store.lookup(keys).tiers == ("disk",) * 4 + ("cpu",) * 2
    store.delete([keys[2]])
    assert store.lookup(keys).tiers == ("disk", "disk")
    disk = store.lower[0]
    disk.path(keys[1].name).unlink()
    disk._forget(keys[1].name)
    assert store.lookup(keys).tiers == ("disk", "redis")
    assert store.lookup([]).num_chunks == 0
    snapshot = store.stats().counters
    assert snapshot["lookups"] == 4 and snapshot["lookup_hit_chunks"] == 10


def test_load_reports_each_key(open_store):
    store = open_store("cpu,disk")
    keys = save_chunks(store, [0, 1, 3])
    wanted = [keys[0], keys[1], store.key(block_hash(2)), keys[2]]
    outs = outputs(store.spec, 4)
    result = store.load(wanted, outs).result(10)
    assert result.ok == (True, True, False, True) and result.num_leading_ok == 2
    assert bits_equal(outs[3], chunk_payload(store.spec, 3))
    assert bits_equal(outs[2], torch.full(store.spec.shape, 7, dtype=store.spec.dtype))


@pytest.mark.parametrize("tiers", ["cpu,disk", "disk", "redis"])
def test_save_copies_the_callers_tensors_before_returning(open_store, tiers):
    store = open_store(tiers)
    key = store.key(block_hash(0))
    staging = chunk_payload(store.spec, 0).clone()
    future = store.save([key], [staging])
    staging.fill_(0)  # the caller reuses its staging buffer at once
    assert future.result(10).complete
    out = outputs(store.spec, 1)
    store.load([key], out).result(10)
    assert bits_equal(out[0], chunk_payload(store.spec, 0))


def test_corrupt_disk_records_are_counted_misses_and_removed(open_store):
    store = open_store("disk")
    keys = save_chunks(store, range(3))
    disk = store.lower[0]
    flipped = bytearray(disk.path(keys[0].name).read_bytes())
    flipped[HEADER_SIZE + 10] ^= 0xFF
    disk.path(keys[0].name).write_bytes(bytes(flipped))
    disk.path(keys[1].name).write_bytes(disk.path(keys[1].name).read_bytes()[:500])
    result = store.load(keys, outputs(store.spec, 3)).result(10)
    assert result.ok == (False, False, True)
    counters = store.stats().tiers["disk"].counters
    assert counters["checksum_failures"] == 2 and counters["misses"] == 2 and counters["hits"] == 1
    deadline = time.monotonic() + 5
    while disk.path(keys[0].name).exists() or disk.path(keys[1].name).exists():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_record_of_another_model_under_our_key_is_rejected(open_store):
    store = open_store("disk")
    key = store.key(block_hash(0))
    other = RecordCodec(make_spec(fingerprint=b"\x02" * 32))
    forged = other.encode(key.block_hash, tensor_bytes(chunk_payload(store.spec, 0)))
    path = store.lower[0].path(key.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes(forged))
    assert store.lookup([key]).tiers == ("disk",)
    assert store.load([key], outputs(store.spec, 1)).result(10).ok == (False,)
    assert store.stats().tiers["disk"].counters["rejected_records"] == 1


def test_other_secret_and_raw_set_are_rejected_in_redis(open_store, redis_server):
    writer = open_store("redis", secret="alpha")
    reader = open_store("redis", secret="beta")
    keys = save_chunks(writer, range(2))
    redis_server.client().set("kvtier:" + keys[1].name, b"raw bytes from someone else")
    assert reader.load(keys, outputs(reader.spec, 2)).result(10).ok == (False, False)
    counters = reader.stats().tiers["redis"].counters
    assert counters["auth_failures"] == 1 and counters["checksum_failures"] == 1


def test_different_models_and_chunk_sizes_never_share(open_store):
    a = open_store("redis")
    b = open_store("redis", make_spec(fingerprint=b"\x03" * 32))
    c = open_store("redis", make_spec(chunk_tokens=32))
    keys = save_chunks(a, range(2))
    for other in (b, c):
        other_keys = [other.key(block_hash(i)) for i in range(2)]
        assert other.lookup(other_keys).num_chunks == 0
        assert other_keys[0].name != keys[0].name


def test_lower_tier_hits_are_promoted_into_cpu(open_store, tmp_path):
    first = open_store("disk")
    keys = save_chunks(first, range(3))
    store = open_store("cpu,disk")
    assert store.lookup(keys).tiers == ("disk",) * 3
    assert store.load(keys, outputs(store.spec, 3)).result(10).tiers == ("disk",) * 3
    assert store.lookup(keys).tiers == ("cpu",) * 3
    assert store.stats().counters["promotions"] == 3


def test_prefetch_pulls_chunks_into_cpu(open_store):
    keys = save_chunks(open_store("disk,redis"), range(4))
    store = open_store("cpu,redis")
    assert store.lookup(keys).tiers == ("redis",) * 4
    assert store.prefetch(keys).result(10) == 4
    assert store.lookup(keys).tiers == ("cpu",) * 4
    outs = outputs(store.spec, 4)
    assert store.load(keys, outs).result(10).tiers == ("cpu",) * 4
    assert all(bits_equal(o, chunk_payload(store.spec, i)) for i, o in enumerate(outs))
    assert store.prefetch(keys).result(10) == 0  # nothing left to fetch


def test_overlapping_prefetches_and_loads_agree(open_store):
    keys = save_chunks(open_store("disk"), range(6))
    store = open_store("cpu,disk")
    first, second = store.prefetch(keys[:4]), store.prefetch(keys[2:])
    outs = outputs(store.spec, 6)
    result = store.load(keys, outs).result(10)
    assert all(result.ok) and first.result(10) + second.result(10) <= 6
    assert all(bits_equal(o, chunk_payload(store.spec, i)) for i, o in enumerate(outs))
    assert store.lookup(keys).tiers == ("cpu",) * 6


def test_restart_finds_what_the_disk_tier_wrote(open_store):
    first = open_store("cpu,disk")
    keys = save_chunks(first, range(5))
    first.close()
    again = open_store("cpu,disk")
    assert again.lookup(keys).tiers == ("disk",) * 5
    outs = outputs(again.spec, 5)
    assert all(again.load(keys, outs).result(10).ok)
    assert all(bits_equal(o, chunk_payload(again.spec, i)) for i, o in enumerate(outs))


def test_pinned_prefix_survives_heavy_traffic(open_store):
    spec = make_spec()
    store = open_store("cpu", spec, cpu_size=4 * spec.nbytes)
    pinned = [store.key(block_hash(i)) for i in range(2)]
    store.pin(pinned, ttl_s=60)  # pinned before it exists, like a system prompt
    save_chunks(store, range(2))
    for i in range(100, 140):
        store.save([store.key(block_hash(i))], [chunk_payload(spec, i)]).result(10)
    assert store.lookup(pinned).tiers == ("cpu", "cpu")
    assert store.stats().pinned_chunks == 2
    assert store.unpin(pinned) == 2
    for i in range(200, 204):
        store.save([store.key(block_hash(i))], [chunk_payload(spec, i)]).result(10)
    assert store.lookup(pinned).num_chunks == 0


def test_crashed_writer_is_restarted_and_counted(open_store, monkeypatch):
    store = open_store("cpu,disk")
    disk = store.lower[0]
    real_put = disk.put
    calls = []

    async def broken_once(items):
        calls.append(len(items))
        if len(calls) == 1:
            raise RuntimeError("injected writer bug")
        return await real_put(items)

    monkeypatch.setattr(disk, "put", broken_once)
    key = store.key(block_hash(0))
    result = store.save([key], [chunk_payload(store.spec, 0)]).result(10)
    assert result.stored == (frozenset({"cpu"}),) and not result.complete
    assert sum(store.stats().worker_restarts.values()) == 1
    assert (
        store.save([store.key(block_hash(1))], [chunk_payload(store.spec, 1)]).result(10).complete
    )


def test_pending_write_budget_drops_instead_of_blocking(open_store):
    store = open_store("cpu,disk", max_pending_write_bytes=0)
    key = store.key(block_hash(0))
    result = store.save([key], [chunk_payload(store.spec, 0)]).result(10)
    assert result.stored == (frozenset({"cpu"}),)
    assert store.stats().counters["save_dropped_chunks"] == 1


def test_close_finishes_pending_writes(open_store, tmp_path):
    store = open_store("disk")
    futures = [
        store.save([store.key(block_hash(i))], [chunk_payload(store.spec, i)]) for i in range(20)
    ]
    store.close()
    assert all(f.done() and f.result().complete for f in futures)
    with pytest.raises(StoreClosedError):
        store.lookup([store.key(block_hash(0))])
    again = open_store("disk")
    assert again.lookup([again.key(block_hash(i)) for i in range(20)]).num_chunks == 20


def test_close_gives_up_on_a_stuck_tier_in_bounded_time(redis_factory, tmp_path):
    server = redis_factory()
    store = TieredStore.from_options(
        make_spec(), tiers="cpu,redis", redis_url=server.url, redis_op_timeout_s=30
    )
    server.pause()
    try:
        future = store.save([store.key(block_hash(0))], [chunk_payload(store.spec, 0)])
        start = time.monotonic()
        store.close(timeout_s=0.3)
        assert time.monotonic() - start < 3
        assert future.done() and future.result().stored == (frozenset({"cpu"}),)
    finally:
        server.resume()


def test_redis_outage_is_misses_then_recovery(redis_factory):
    server = redis_factory()
    spec = make_spec()
    store = TieredStore.from_options(
        spec,
        tiers="redis",
        redis_url=server.url,
        redis_op_timeout_s=0.5,
        redis_probe_interval_s=0.05,
    )
    try:
        store.lower[0].health = type(store.lower[0].health)(min_backoff_s=0.05, max_backoff_s=0.2)
        keys = save_chunks(store, range(2))
        server.kill()
        start = time.monotonic()
        assert store.lookup(keys).num_chunks == 0
        assert store.load(keys, outputs(spec, 2)).result(5).ok == (False, False)
        assert not store.save(keys, [chunk_payload(spec, 0)] * 2).result(5).complete
        assert time.monotonic() - start < 2
        assert store.health() == {"redis": "unhealthy"}
        server.start()
        deadline = time.monotonic() + 5
        while store.health()["redis"] != "healthy":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        save_chunks(store, range(2))
        assert store.lookup(keys).num_chunks == 2
    finally:
        store.close()


def test_lookup_with_a_stalled_redis_is_bounded(redis_factory):
    server = redis_factory()
    spec = make_spec()
    store = TieredStore.from_options(
        spec, tiers="cpu,redis", redis_url=server.url, lookup_timeout_s=0.2
    )
    try:
        keys = save_chunks(store, range(2))
        store.flush(["cpu"])
        assert store.lookup(keys).tiers == ("redis", "redis")
        server.pause()
        start = time.monotonic()
        assert store.lookup(keys).num_chunks == 0
        assert store.lookup(keys).num_chunks == 0  # unhealthy now: no second wait
        assert time.monotonic() - start < 1.0
        assert store.health()["redis"] == "unhealthy"
    finally:
        server.resume()
        store.close()


def test_load_timeout_always_resolves(redis_factory):
    server = redis_factory()
    spec = make_spec()
    store = TieredStore.from_options(
        spec, tiers="redis", redis_url=server.url, redis_op_timeout_s=30
    )
    try:
        keys = save_chunks(store, range(2))
        server.pause()
        start = time.monotonic()
        result = store.load(keys, outputs(spec, 2), timeout_s=0.3).result(5)
        assert result.ok == (False, False) and time.monotonic() - start < 2
    finally:
        server.resume()
        store.close()


def test_cluster_store_roundtrip(redis_cluster):
    store = TieredStore.from_options(
        make_spec(torch.bfloat16), tiers="redis", redis_url=redis_cluster, compress="lz4"
    )
    try:
        keys = save_chunks(store, range(12))
        assert store.lookup(keys).tiers == ("redis",) * 12
        outs = outputs(store.spec, 12)
        assert all(store.load(keys, outs).result(10).ok)
        assert all(bits_equal(o, chunk_payload(store.spec, i)) for i, o in enumerate(outs))
        assert store.flush() == {"redis": 12}
    finally:
        store.close()


def test_flush_spares_other_models(open_store):
    mine = open_store("cpu,disk")
    other = open_store("disk", make_spec(fingerprint=b"\x04" * 32))
    save_chunks(mine, range(3))
    other_keys = save_chunks(other, range(2))
    assert mine.flush() == {"cpu": 3, "disk": 3}
    assert other.lookup(other_keys).num_chunks == 2


def test_stats_snapshot(open_store):
    store = open_store("cpu,disk")
    keys = save_chunks(store, range(2))
    store.load(keys, outputs(store.spec, 2)).result(10)
    snap = store.stats()
    cpu = snap.tiers["cpu"]
    assert cpu.counters["hits"] == 2 and cpu.hit_tokens == 2 * store.spec.chunk_tokens
    as_dict = snap.as_dict()
    assert as_dict["tiers"]["disk"]["bytes_written"] > 2 * store.spec.nbytes
    assert as_dict["tiers"]["disk"]["health"] == "healthy"
    assert as_dict["tiers"]["cpu"]["put_latency"]["count"] == 2


def test_misuse_raises_specific_errors(open_store, tmp_path):
    with pytest.raises(StoreConfigError):
        TieredStore.from_options(make_spec(), tiers="cpu,tape")
    with pytest.raises(StoreConfigError):
        TieredStore.from_options(make_spec(), tiers="disk")
    with pytest.raises(StoreConfigError):
        TieredStore.from_options(make_spec(), tiers="redis")
    with pytest.raises(StoreConfigError):
        TieredStore.from_options(make_spec(), tiers="cpu", compress="zstd")
    with pytest.raises(StoreConfigError):
        TieredStore.from_options(make_spec(), tiers="cpu", cpu_size=10)
    store = open_store("cpu")
    key = store.key(block_hash(0))
    with pytest.raises(ChunkSpecError):
        store.save([key], [torch.zeros(3)])
    with pytest.raises(ChunkSpecError):
        store.load([key], [torch.zeros(store.spec.shape, dtype=torch.float16)])
    with pytest.raises(StoreConfigError):
        store.key(b"short")
