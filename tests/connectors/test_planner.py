"""The planner: chunk geometry, save plans per step, and lookups that wait for a remote
index, against a real TieredStore (no device cache, no model)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import time
from concurrent.futures import wait
from pathlib import Path

import pytest
import torch

from bench.store_io import save_tensors
from connectors.planner import ChunkGeometry, Planner
from engine.hashing import BlockHasher
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from kvstore import ChunkSpec, StoreConfig, TieredStore

GEOMETRY = ChunkGeometry(block_size=4, chunk_tokens=16)  # 4 blocks per chunk
FINGERPRINT = hashlib.sha256(b"planner-test-model").digest()
SPEC = ChunkSpec.for_kv_layout(FINGERPRINT, num_layers=1, block_size=4, num_kv_heads=1, head_dim=4,
                               dtype=torch.float32, chunk_tokens=16)
REPO = Path(__file__).resolve().parents[2]


def make_request(request_id: str, tokens: list[int]) -> Request:
    request = Request(request_id, tokens, SamplingParams(max_tokens=4))
    BlockHasher(FINGERPRINT, 4).extend(request.block_hashes, tokens, None)
    return request


@pytest.fixture
def store():
    with TieredStore.from_config(SPEC, StoreConfig(kv_offload="cpu", kv_offload_cpu_size="1MiB")) as store:
        yield store


@pytest.mark.parametrize(("num_tokens", "blocks"), [(1, 0), (4, 0), (5, 1), (16, 3), (17, 4), (33, 8)])
def test_loadable_blocks_leave_the_last_token(num_tokens, blocks):
    assert GEOMETRY.loadable_blocks(num_tokens) == blocks


@pytest.mark.parametrize(("full_blocks", "tail"), [(0, None), (3, range(0, 3)), (4, None), (6, range(4, 6))])
def test_the_tail_record_holds_the_blocks_past_the_last_chunk_boundary(full_blocks, tail):
    assert GEOMETRY.tail(full_blocks) == tail


def test_the_planner_imports_without_torch():
    code = "import sys; sys.modules['torch'] = None; import connectors.planner"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_a_chunked_prefill_saves_each_record_once_its_blocks_are_computed(store):
    planner = Planner(store.manager, store.transfers, GEOMETRY, save_decode=False)
    request = make_request("a", list(range(100, 126)))  # 6 full blocks: a full record and a tail
    table = list(range(7))
    assert planner.match(request, 0) == (0, False)
    planner.allocated(request, table, 0)
    request.num_computed_tokens = 12  # the first prefill chunk: 3 blocks
    assert planner.build(SchedulerOutput(requests=[request], block_tables=[table])).saves == []
    request.num_computed_tokens = 26  # the rest of the prompt
    saves = planner.build(SchedulerOutput(requests=[request], block_tables=[table])).saves
    assert [(s.first_block, s.block_ids) for s in saves] == [(0, (0, 1, 2, 3)), (4, (4, 5))]
    assert saves[1].block_hashes == tuple(request.block_hashes[4:6])
    request.num_computed_tokens = 40  # decoding: outputs are not saved without save_decode
    assert planner.build(SchedulerOutput(requests=[request], block_tables=[table])).saves == []


def test_a_stored_record_is_planned_only_once_and_loads_cover_any_shared_run(store):
    a = make_request("a", list(range(100, 126)))
    blocks = torch.zeros(4, *SPEC.block_shape)
    assert save_tensors(store, [store.manager.key(a.block_hashes[:4])], [blocks]).result(5).complete
    planner = Planner(store.manager, store.transfers, GEOMETRY, save_decode=False)
    b = make_request("b", a.prompt_token_ids[:10] + [7] * 16)  # shares 2 blocks, then differs
    assert planner.match(b, 0) == (8, False)  # blocks 0-1, read out of a's record [0..3]
    planner.allocated(b, list(range(7)), 8)
    b.num_computed_tokens = b.num_tokens
    saves = planner.build(SchedulerOutput(requests=[b], block_tables=[list(range(7))])).saves
    assert [s.first_block for s in saves] == [0, 4]  # b's own records (their names differ from a's)
    again = make_request("c", a.prompt_token_ids)
    assert planner.match(again, 0) == (16, False)


def test_a_lookup_waits_for_the_remote_index_then_finds_another_instances_records(redis_url, tmp_path):
    request = make_request("a", list(range(100, 126)))
    with TieredStore.from_config(SPEC, StoreConfig(kv_offload="redis", kv_redis_url=redis_url)) as writer:
        keys = [writer.manager.key(request.block_hashes[:4]), writer.manager.key(request.block_hashes[4:6], 4)]
        payloads = [torch.zeros(4, *SPEC.block_shape), torch.ones(2, *SPEC.block_shape)]
        assert save_tensors(writer, keys, payloads).result(5).complete
    with TieredStore.from_config(SPEC, StoreConfig(kv_offload="redis", kv_redis_url=redis_url, kv_lookup_timeout=5)) as reader:
        planner = Planner(reader.manager, reader.transfers, GEOMETRY, save_decode=False)
        assert reader.manager.locate(request.block_hashes, 0, 6) == []
        assert planner.match(request, 0) == (None, False)  # the probe of Redis's index is out
        deadline = time.monotonic() + 10
        answer = (None, False)
        while answer[0] is None and time.monotonic() < deadline:
            probe = planner.requests["a"].probe
            if probe is not None:
                wait([probe], 1)
            answer = planner.match(request, 0)
        assert answer == (24, True)  # every loadable block, read asynchronously from Redis
        planner.allocated(request, list(range(7)), 24)
        deadline = time.monotonic() + 10
        while not planner.finished_loads() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert planner.take_load_tiers("a") == [("redis", 24)]


def test_load_tiers_are_the_runs_a_settled_load_delivered_read_once(store):
    a = make_request("a", list(range(100, 126)))
    assert save_tensors(store, [store.manager.key(a.block_hashes[:4])], [torch.zeros(4, *SPEC.block_shape)]).result(5).complete
    planner = Planner(store.manager, store.transfers, GEOMETRY, save_decode=False)
    b = make_request("b", a.prompt_token_ids[:10] + [7] * 16)
    assert planner.match(b, 0) == (8, False)
    assert planner.take_load_tiers("b") == []  # not admitted yet
    planner.allocated(b, list(range(7)), 8)
    assert planner.take_load_tiers("b") == [("cpu", 8)]
    assert planner.take_load_tiers("b") == []
