"""KV events (--kv-events-config): a subscriber written against vLLM's schema (the structs
below mirror vllm/distributed/kv_events.py, map-encoded events in an array batch) rebuilds
exactly what the instance holds, per medium, from the stream alone: after evictions,
preemptions, a flush and a restart; one that drops batches catches up through the
replay endpoint. Real tiers (cpu memory, files, a real redis-server), real ZMQ sockets."""

from __future__ import annotations

import pytest
from offload_workloads import CHUNK, generate, random_prompts

from engine import LLM
from engine.config import ConfigError
from tests.kv_event_subscriber import Subscriber, free_port

MEDIUMS = {"cpu": "CPU", "disk": "DISK", "redis": "SHARED:REDIS"}
POOL = {"dtype": "float32", "num_kv_blocks": 24, "max_num_batched_tokens": 64, "max_num_seqs": 4,
        "kv_chunk_tokens": CHUNK}
CHUNK_BYTES = CHUNK * 2 * 2 * 2 * 16 * 4


def external(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")


def events_config(pub: int, replay: int) -> dict:
    return {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://*:{replay}", "topic": "kv"}


def settle(llm: LLM) -> int:
    """Every write done and applied, every event sent: the last batch's number."""
    engine = llm.engine
    store = engine.connector.store
    assert store.drain(timeout_s=60)
    assert engine.kv_events.publisher.flush()
    return engine.kv_events.publisher.last_seq


def instance_state(llm: LLM) -> dict[str, set[int]]:
    """What the instance holds, read from its device pool and its store's index."""
    engine = llm.engine
    state = {"GPU": {external(h) for h in engine.kv_cache_manager.block_pool.cached}}
    for record in engine.connector.store.manager.index.records():
        for tier in record.tiers:
            state.setdefault(MEDIUMS[tier], set()).update(external(h) for h in record.block_hashes if h)
    return {medium: hashes for medium, hashes in state.items() if hashes}


@pytest.mark.parametrize("tiers", ["cpu,disk", "cpu,disk,redis"])
def test_a_subscriber_rebuilds_each_medium_exactly(tiny_llama, tmp_path, request, tiers):
    pub, replay = free_port(), free_port()
    options = {**POOL, "kv_offload": tiers, "kv_offload_disk_path": str(tmp_path / "disk"),
               "kv_offload_cpu_size": f"{12 * CHUNK_BYTES}B", "kv_events_config": events_config(pub, replay)}
    if "redis" in tiers:
        options["kv_redis_url"] = request.getfixturevalue("redis_url")
    subscriber = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    prompts = random_prompts([150, 97, 260, 33, 81, 120, 200, 64], vocab_size=480, seed=3)
    try:
        with LLM(model=tiny_llama, **options) as llm:
            generate(llm, prompts, [8] * len(prompts))  # more than the pool and the cpu tier hold
            stats = llm.stats()
            assert stats["num_preemptions_total"] > 0 and stats["kv_tiers"]["cpu"]["evictions"] > 0
            subscriber.catch_up(settle(llm))
            state = instance_state(llm)
            assert {"GPU", "CPU", "DISK"} <= set(state)
            assert subscriber.state() == state

            assert llm.engine.kv_flush(["cpu"]).result(timeout=60)["cpu"] > 0
            generate(llm, prompts[:2], [4, 4])
            subscriber.catch_up(settle(llm))
            assert subscriber.state() == instance_state(llm)
    finally:
        subscriber.close()


def test_shared_redis_blocks_are_announced_by_their_writer_only(tiny_llama, request):
    redis = {"kv_redis_url": request.getfixturevalue("redis_url"), "kv_offload": "cpu,redis",
             "kv_offload_cpu_size": f"{12 * CHUNK_BYTES}B"}
    prompt = random_prompts([160], vocab_size=480, seed=9)
    ports = [(free_port(), free_port()) for _ in range(2)]
    subscribers = [Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}") for pub, replay in ports]
    try:
        with LLM(model=tiny_llama, **POOL, **redis, kv_events_config=events_config(*ports[0])) as writer:
            generate(writer, prompt, [2])
            subscribers[0].catch_up(settle(writer))
            written = subscribers[0].state()["SHARED:REDIS"]
            assert len(written) == 160 // 16
        with LLM(model=tiny_llama, **POOL, **redis, kv_events_config=events_config(*ports[1])) as reader:
            generate(reader, prompt, [2])
            stats = reader.stats()
            assert stats["kv_external_hit_tokens_redis"] >= 128  # it loaded the writer's records
            subscribers[1].catch_up(settle(reader))
            held = subscribers[1].state()
            assert held["CPU"] >= written  # loaded into its cpu tier: its own copies, announced
            assert "SHARED:REDIS" not in held  # the writer announced those; this one only read them
    finally:
        for subscriber in subscribers:
            subscriber.close()


def test_a_restart_clears_then_announces_the_rebuilt_disk_index(tiny_llama, tmp_path):
    options = {**POOL, "kv_offload": "disk", "kv_offload_disk_path": str(tmp_path / "disk")}
    prompts = random_prompts([130, 90], vocab_size=480, seed=5)
    with LLM(model=tiny_llama, **options) as llm:
        generate(llm, prompts, [4, 4])
    pub, replay = free_port(), free_port()
    subscriber = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
    subscriber.held["DISK"] = {1, 2, 3}  # what an earlier run announced, gone with it
    try:
        with LLM(model=tiny_llama, **options, kv_events_config=events_config(pub, replay)) as llm:
            subscriber.catch_up(settle(llm))
            state = instance_state(llm)
            assert len(state["DISK"]) == (128 + 80) // 16
            assert subscriber.state() == state
    finally:
        subscriber.close()


def test_a_subscriber_that_misses_batches_catches_up_by_replay(tiny_llama, tmp_path):
    pub, replay = free_port(), free_port()
    options = {**POOL, "kv_offload": "cpu", "kv_offload_cpu_size": f"{12 * CHUNK_BYTES}B",
               "kv_events_config": events_config(pub, replay)}
    subscriber = Subscriber(f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}", drop={1, 2, 5})
    try:
        with LLM(model=tiny_llama, **options) as llm:
            for prompt in random_prompts([150, 97, 260, 33, 81], vocab_size=480, seed=7):
                generate(llm, [prompt], [3])
                llm.engine.kv_events.publisher.flush()  # one batch at least per request
            subscriber.catch_up(settle(llm))
            assert subscriber.replayed >= 3
            assert subscriber.state() == instance_state(llm)
    finally:
        subscriber.close()


def test_bad_kv_events_config_names_the_flag_and_key(tiny_llama):
    with pytest.raises(ConfigError, match=r"kv_events_config: publisher: "):
        LLM(model=tiny_llama, kv_events_config='{"enable_kv_cache_events": true, "publisher": "kafka"}')
    with pytest.raises(ConfigError, match=r"kv_events_config: .*endpoint"):
        LLM(model=tiny_llama, kv_events_config={"enable_kv_cache_events": True, "endpoint": "tcp://*:notaport"})
