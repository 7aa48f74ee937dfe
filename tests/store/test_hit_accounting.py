"""Where the store's hits are counted (issue 44, item 9), on real tiers and a real
redis-server: a probe of Redis that runs past the lookup timeout is counted and logged
once; a record prefetched from Redis into the cpu tier is a Redis hit when a load takes
it (and a cpu hit only after that)."""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from bench.store_io import save_tensors
from kvstore import StoreConfig, TieredStore
from tests.store.store_helpers import bits_equal, make_spec

BLOCKS = 4  # blocks per record in make_spec()
PROBE_WAIT_S = 60  # a probe's future: done after the lookup timeout, however busy the host
PROBE_TIMEOUT_WARNING = "took longer than the lookup timeout"


def sequence(i: int, blocks: int) -> list[bytes]:
    return [hashlib.sha256(f"hits-{i}-{b}".encode()).digest() for b in range(blocks)]


@pytest.fixture
def open_store(tmp_path):
    stores: list[TieredStore] = []

    def make(tiers: str, redis_url: str, **options) -> TieredStore:
        options.setdefault("kv_offload_cpu_size", "1MiB")
        # the test machine may be busy: no probe or read may give up early
        options.setdefault("kv_lookup_timeout", 30.0)
        options.setdefault("kv_redis_op_timeout", 30.0)
        options.setdefault("kv_load_timeout", 60.0)
        store = TieredStore.from_config(make_spec(), StoreConfig(kv_offload=tiers, kv_redis_url=redis_url, **options))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def save_sequence(store: TieredStore, i: int, blocks: int) -> torch.Tensor:
    hashes = sequence(i, blocks)
    payload = torch.randn(blocks, *store.spec.block_shape).to(store.spec.dtype)
    keys = [store.manager.key(hashes[s : s + BLOCKS], s) for s in range(0, blocks, BLOCKS)]
    assert save_tensors(store, keys, [payload[s : s + BLOCKS].clone() for s in range(0, blocks, BLOCKS)]).result(30).complete
    assert store.drain(30)
    return payload


def load_blocks(store: TieredStore, hashes: list[bytes], start: int, end: int) -> tuple[torch.Tensor, list]:
    """Open, wait for and close a load of blocks [start, end): their payload, parts' tiers."""
    load = store.transfers.open_load(store.manager.locate(hashes, start, end))
    load.wait(30)
    found = torch.cat([store.transfers.view(part).clone() for part in load.parts])
    tiers = [part.tier for part in load.parts]
    store.transfers.close_load(load)
    return found, tiers


def test_a_probe_past_the_lookup_timeout_is_counted_and_logged_once(open_store, redis_factory, caplog):
    server = redis_factory()
    writer = open_store("redis", server.url)
    save_sequence(writer, 1, 8)
    # Redis's own timeout is long, so the tier stays healthy and only the probe's bound acts.
    reader = open_store("cpu,redis", server.url, kv_lookup_timeout=0.2, kv_redis_op_timeout=60.0)
    hashes = sequence(1, 8)
    caplog.set_level(logging.WARNING, logger="kvstore")
    server.pause()  # SIGSTOP: connections stay open, nothing answers
    try:
        for _ in range(3):
            assert reader.manager.probe(hashes, 0, 8).result(PROBE_WAIT_S) == 0
    finally:
        server.resume()
    assert reader.stats().tiers["redis"].counters["probe_timeouts"] == 3
    warnings = [r for r in caplog.records if PROBE_TIMEOUT_WARNING in r.getMessage()]
    assert len(warnings) == 1 and "--kv-lookup-timeout" in warnings[0].getMessage()
    # what those probes missed was there: a probe with time to get its answer finds it
    assert open_store("cpu,redis", server.url).manager.probe(hashes, 0, 8).result(PROBE_WAIT_S) == 8


def test_probe_timeouts_are_exported_per_tier():
    from prometheus_client.parser import text_string_to_metric_families

    from engine.server.metrics import ServerMetrics

    metrics = ServerMetrics("tiny", ("cpu", "redis"))
    metrics.watch(lambda: {"kv_tiers": {"cpu": {}, "redis": {"probe_timeouts": 3}}})
    body, _ = metrics.render()
    samples = {(s.name, s.labels.get("tier")): s.value
               for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    assert samples[("kvtier:store_probe_timeouts_total", "redis")] == 3
    assert samples[("kvtier:store_probe_timeouts_total", "cpu")] == 0


def test_a_record_prefetched_from_redis_is_a_redis_hit_for_the_load_that_takes_it(open_store, redis_url):
    writer = open_store("redis", redis_url)
    payload = save_sequence(writer, 2, 8)
    reader = open_store("cpu,redis", redis_url)
    hashes = sequence(2, 8)
    assert reader.manager.probe(hashes, 0, 8).result(PROBE_WAIT_S) == 8
    assert reader.transfers.prefetch_run(reader.manager.locate(hashes, 0, 8)).wait(30)
    reader.manager.poll()
    assert all("cpu" in location.record.tiers for location in reader.manager.locate(hashes, 0, 8))

    found, tiers = load_blocks(reader, hashes, 0, 8)  # from the cpu tier, for what it came for
    assert bits_equal(found, payload) and tiers == ["redis", "redis"]
    counters = {name: reader.stats().tiers[name].counters["hits"] for name in ("cpu", "redis")}
    assert counters == {"cpu": 0, "redis": 2}

    _, tiers = load_blocks(reader, hashes, 0, 8)  # again: the cpu tier's own hit now
    assert tiers == ["cpu", "cpu"]
    assert reader.stats().tiers["cpu"].counters["hits"] == 2
