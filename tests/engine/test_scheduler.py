"""Scheduler behaviour against a fake model that really reads its KV back.

`FakeModel` writes each computed token into its slot of a fake KV cache (slot -> token id)
and samples the next token as a function of the tokens it reads back through the block
table. A wrong block table, a stale prefix hit or a wrong start position therefore
changes the output, and every output is compared with a direct computation.
"""

from __future__ import annotations

import random
import zlib
from array import array

import pytest

from connectors.base import NullConnector
from engine.config import EngineConfig
from engine.hashing import BlockHasher
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import RequestTooLongError, Scheduler, SchedulerOutput

BS = 4
VOCAB = 1000


def next_token(history: list[int]) -> int:
    return zlib.crc32(array("I", history).tobytes()) % VOCAB


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def slot(block_table: list[int], position: int) -> int:
    return block_table[position // BS] * BS + position % BS


class FakeModel:
    def __init__(self) -> None:
        self.kv: dict[int, int] = {}

    def execute(self, out: SchedulerOutput) -> dict[str, tuple[int, float | None]]:
        sampled = {}
        for request, num_new, start, table, sample in zip(
            out.requests, out.num_new_tokens, out.start_positions, out.block_tables, out.sample,
            strict=True,
        ):
            tokens = request.all_token_ids
            for position in range(start, start + num_new):
                self.kv[slot(table, position)] = tokens[position]
            if sample:
                history = [self.kv[slot(table, p)] for p in range(start + num_new)]
                sampled[request.request_id] = (next_token(history), None)
        return sampled


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int | None = None,
    connector=None,
) -> Scheduler:
    config = EngineConfig(
        block_size=BS, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
    )
    manager = KVCacheManager(num_blocks, BS)
    return Scheduler(config, manager, BlockHasher(b"fake-model", BS), connector)


def make_request(request_id: str, prompt: list[int], max_tokens: int = 4, **params) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params))


def check_blocks(scheduler: Scheduler) -> None:
    """Reference counts equal the number of tables holding a block; the free queue holds
    exactly the unreferenced blocks; the cache map and block hashes agree."""
    pool = scheduler.kv.block_pool
    holders = [0] * pool.num_blocks
    for table in scheduler.kv.req_to_blocks.values():
        for block in table:
            holders[block.block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == holders
    free = {b.block_id for b in pool.free_queue.blocks()}
    assert free == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    assert all(block.block_hash == h for h, block in pool.cached.items())
    assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached)


def step(scheduler: Scheduler, model: FakeModel) -> SchedulerOutput:
    out = scheduler.schedule()
    check_blocks(scheduler)
    scheduler.update_from_output(out, model.execute(out))
    check_blocks(scheduler)
    return out


def run(scheduler: Scheduler, model: FakeModel, max_steps: int = 10_000) -> list[SchedulerOutput]:
    outputs = []
    while scheduler.has_unfinished_requests():
        out = step(scheduler, model)
        assert out.requests, "a step with unfinished requests scheduled nothing"
        outputs.append(out)
        assert len(outputs) < max_steps
    return outputs


def assert_all_blocks_released(scheduler: Scheduler) -> None:
    pool = scheduler.kv.block_pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert scheduler.kv.req_to_blocks == {}


def test_random_workload_under_memory_pressure_matches_reference():
    rng = random.Random(0)
    scheduler = make_scheduler(num_blocks=24, budget=20, max_num_seqs=6)
    model = FakeModel()
    shared = [rng.randrange(VOCAB) for _ in range(3 * BS)]
    requests = []
    for i in range(30):
        prefix = shared if i % 2 else []
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
        requests.append(make_request(f"r{i}", prompt, max_tokens=rng.randrange(1, 20)))
    for request in requests:
        scheduler.add_request(request)
    outputs = run(scheduler, model)
    for request in requests:
        assert request.output_token_ids == reference(request.prompt_token_ids, request.sampling_params.max_tokens)
        assert request.status == RequestStatus.FINISHED_LENGTH
    for out in outputs:
        assert out.total_num_tokens <= 20
        assert len(out.requests) <= 6
    stats = scheduler.stats()
    assert stats["num_preemptions_total"] > 0
    assert stats["prefix_cache_hits"] > 0
    assert_all_blocks_released(scheduler)


def test_chunked_prefill_over_several_steps():
    scheduler = make_scheduler(budget=8)
    model = FakeModel()
    request = make_request("a", list(range(20)), max_tokens=2)
    scheduler.add_request(request)
    outputs = run(scheduler, model)
    assert [o.start_positions[0] for o in outputs] == [0, 8, 16, 20]
    assert [o.num_new_tokens[0] for o in outputs] == [8, 8, 4, 1]
    assert [o.sample[0] for o in outputs] == [False, False, True, True]
    assert request.output_token_ids == reference(list(range(20)), 2)


def test_decodes_go_before_waiting_prefills_in_a_mixed_step():
    scheduler = make_scheduler(budget=8)
    model = FakeModel()
    for rid in ("a", "b"):
        scheduler.add_request(make_request(rid, [1, 2, 3], max_tokens=10))
    step(scheduler, model)
    scheduler.add_request(make_request("c", list(range(30)), max_tokens=1))
    out = step(scheduler, model)
    assert [r.request_id for r in out.requests] == ["a", "b", "c"]
    assert out.num_new_tokens == [1, 1, 6]
    assert out.sample == [True, True, False]
    assert out.total_num_tokens == 8


def test_several_chunked_prompts_progress_in_shared_steps():
    scheduler = make_scheduler(budget=16)
    model = FakeModel()
    requests = [make_request("a", list(range(40)), 3), make_request("b", list(range(100, 140)), 3)]
    for request in requests:
        scheduler.add_request(request)
    outputs = run(scheduler, model)
    assert any(len(o.requests) == 2 and min(o.num_new_tokens) > 1 for o in outputs), (
        "no step carried prefill chunks of both requests"
    )
    for request in requests:
        chunks = [
            n for o in outputs for r, n in zip(o.requests, o.num_new_tokens, strict=True)
            if r is request and n > 1
        ]
        assert len(chunks) >= 3 and sum(chunks) == 40
        assert request.output_token_ids == reference(request.prompt_token_ids, 3)


def test_preempts_the_most_recently_admitted_and_resume_hits_the_prefix_cache():
    # Three 8-token prompts (2 blocks each) and 7 blocks: the third block of the second
    # request does not fit, so the last admitted request ("c") is preempted.
    scheduler = make_scheduler(num_blocks=7)
    model = FakeModel()
    prompts = {rid: [base + i for i in range(8)] for rid, base in (("a", 0), ("b", 100), ("c", 200))}
    requests = {rid: make_request(rid, p, max_tokens=4) for rid, p in prompts.items()}
    for request in requests.values():
        scheduler.add_request(request)
    step(scheduler, model)
    out = step(scheduler, model)
    c = requests["c"]
    assert out.preempted == [c]
    assert [r.request_id for r in out.requests] == ["a", "b"]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert scheduler.waiting[0] is c
    assert scheduler.stats()["num_preemptions_total"] == 1
    outputs = run(scheduler, model)
    resume = next(o for o in outputs if c in o.requests)
    # Its tail block was evicted first, its first block is still cached.
    assert resume.start_positions[resume.requests.index(c)] == BS
    assert scheduler.stats()["prefix_cache_hits"] == BS
    for rid, request in requests.items():
        assert request.output_token_ids == reference(prompts[rid], 4)
    assert_all_blocks_released(scheduler)


def test_no_admission_in_a_step_that_preempted():
    scheduler = make_scheduler(num_blocks=7)
    model = FakeModel()
    for rid, base in (("a", 0), ("b", 100), ("c", 200)):
        scheduler.add_request(make_request(rid, [base + i for i in range(8)], max_tokens=4))
    step(scheduler, model)
    scheduler.add_request(make_request("d", [7]))
    out = step(scheduler, model)
    assert out.preempted
    assert "d" not in {r.request_id for r in out.requests}


def test_max_num_seqs_limits_running_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    model = FakeModel()
    for i in range(5):
        scheduler.add_request(make_request(f"r{i}", [i, i + 1], max_tokens=3))
    outputs = run(scheduler, model)
    assert max(len(o.requests) for o in outputs) == 2
    assert len(outputs[0].requests) == 2 and scheduler.num_waiting == 0


def test_too_long_requests_are_rejected_at_add_time():
    scheduler = make_scheduler(num_blocks=4, max_model_len=64)
    with pytest.raises(RequestTooLongError, match="max-model-len"):
        scheduler.add_request(make_request("a", list(range(60)), max_tokens=8))
    with pytest.raises(RequestTooLongError, match="pool"):
        scheduler.add_request(make_request("b", list(range(10)), max_tokens=8))
    assert not scheduler.has_unfinished_requests()
    # 10 + 7 tokens: the last sampled token needs no slot, so 16 slots are enough.
    fits = make_request("c", list(range(10)), max_tokens=7)
    scheduler.add_request(fits)
    run(scheduler, FakeModel())
    assert fits.num_output_tokens == 7


def test_empty_prompt_and_duplicate_id_are_rejected():
    scheduler = make_scheduler()
    with pytest.raises(ValueError, match="empty"):
        scheduler.add_request(make_request("a", []))
    scheduler.add_request(make_request("a", [1]))
    with pytest.raises(ValueError, match="in flight"):
        scheduler.add_request(make_request("a", [2]))


def run_constant(request: Request, token: int) -> Request:
    """Run one request with a model that always samples `token`."""
    scheduler = make_scheduler()
    scheduler.add_request(request)
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        sampled = {r.request_id: (token, -0.5, []) for r, s in zip(out.requests, out.sample, strict=True) if s}
        scheduler.update_from_output(out, sampled)
    assert_all_blocks_released(scheduler)
    return request


def test_stop_conditions():
    eos = Request("a", [1, 2], SamplingParams(max_tokens=5), eos_token_ids=frozenset({7}))
    assert run_constant(eos, 7).finish_reason == "stop"
    assert eos.output_token_ids == [7] and eos.stop_reason is None
    ignored = Request("b", [1, 2], SamplingParams(max_tokens=5, ignore_eos=True), eos_token_ids=frozenset({7}))
    assert run_constant(ignored, 7).finish_reason == "length"
    assert ignored.num_output_tokens == 5
    stop_id = make_request("c", [1, 2], max_tokens=5, stop_token_ids=[9])
    assert run_constant(stop_id, 9).finish_reason == "stop"
    assert stop_id.stop_reason == 9
    length = make_request("d", [1, 2], max_tokens=3, logprobs=True)
    assert run_constant(length, 5).finish_reason == "length"
    assert length.output_logprobs == [-0.5] * 3
    assert length.finish_time is not None and length.first_token_time is not None


def test_block_hashes_cover_every_full_block_of_prompt_and_output():
    scheduler = make_scheduler()
    request = Request("a", list(range(6)), SamplingParams(max_tokens=11), cache_salt="tenant")
    scheduler.add_request(request)
    assert len(request.block_hashes) == 1
    run(scheduler, FakeModel())
    assert request.num_tokens == 17
    assert request.block_hashes == BlockHasher(b"fake-model", BS).hashes(request.all_token_ids, "tenant")


def test_prefix_hit_at_admission_sets_num_cached_tokens():
    scheduler = make_scheduler()
    model = FakeModel()
    prompt = list(range(3 * BS + 2))
    first = make_request("a", prompt)
    scheduler.add_request(first)
    run(scheduler, model)
    second = make_request("b", prompt)
    scheduler.add_request(second)
    out = step(scheduler, model)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 3 * BS
    assert out.start_positions == [3 * BS] and out.num_new_tokens == [2]
    run(scheduler, model)
    assert second.output_token_ids == first.output_token_ids == reference(prompt, 4)


def test_abort_running_and_waiting_requests_frees_their_blocks():
    scheduler = make_scheduler(max_num_seqs=1)
    model = FakeModel()
    running, waiting = make_request("a", list(range(9))), make_request("b", [1, 2])
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    step(scheduler, model)
    aborted = scheduler.abort_requests(["a", "b", "unknown"])
    assert aborted == [running, waiting]
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_released(scheduler)
    assert scheduler.abort_requests(["a"]) == []


def test_request_finished_while_its_step_runs_is_left_alone():
    scheduler = make_scheduler()
    request = make_request("a", [1, 2, 3])
    scheduler.add_request(request)
    out = scheduler.schedule()
    sampled = FakeModel().execute(out)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert scheduler.update_from_output(out, sampled) == []
    assert request.output_token_ids == []
    assert request.finish_reason == "stop"
    assert_all_blocks_released(scheduler)
    with pytest.raises(ValueError):
        scheduler.finish_requests(["a"], RequestStatus.RUNNING)


class FakeConnector(NullConnector):
    """Supplies `external[request_id]` tokens after the device hit by writing them into
    the fake KV cache as a real load would: at once, or, for an asynchronous load, when
    the test calls `finish_load` (possibly with fewer tokens than promised). A request in
    `unknown` gets no answer (None) until the test calls `answer`. Records finished
    requests and preemptions with the blocks they see."""

    def __init__(self, model: FakeModel, external: dict[str, int], load_async: bool = False) -> None:
        self.model = model
        self.external = external
        self.load_async = load_async
        self.unknown: set[str] = set()
        self.device_hit: dict[str, int] = {}
        self.loaded: dict[str, tuple[int, int]] = {}
        self.in_flight: dict[str, list[int]] = {}
        self.arrived: dict[str, int] = {}
        self.finished: list[str] = []
        self.preempted: list[tuple[str, int, list[int]]] = []

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.device_hit[request.request_id] = num_computed_tokens
        if request.request_id in self.unknown:
            return None, False
        return self.external.get(request.request_id, 0), self.load_async

    def answer(self, request: Request) -> None:
        self.unknown.discard(request.request_id)

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        if self.load_async and num_external_tokens:
            self.in_flight[request.request_id] = block_ids
        else:
            self._write(request, block_ids, num_external_tokens)

    def finish_load(self, request: Request, delivered: int) -> None:
        self._write(request, self.in_flight.pop(request.request_id), delivered)
        self.arrived[request.request_id] = delivered

    def get_finished(self) -> dict[str, int]:
        arrived, self.arrived = self.arrived, {}
        return arrived

    def build_meta(self, output: SchedulerOutput) -> object:
        return {"num_requests": len(output.requests)}

    def request_preempted(self, request: Request, block_ids: list[int]) -> None:
        self.preempted.append((request.request_id, request.num_computed_tokens, block_ids))

    def request_finished(self, request: Request, block_ids: list[int]) -> None:
        self.finished.append(request.request_id)

    def _write(self, request: Request, block_ids: list[int], num_tokens: int) -> None:
        start = self.device_hit[request.request_id]
        for position in range(start, start + num_tokens):
            self.model.kv[slot(block_ids, position)] = request.all_token_ids[position]
        self.loaded[request.request_id] = (start, num_tokens)


def test_connector_hooks_load_external_tokens():
    model = FakeModel()
    connector = FakeConnector(model, {"a": 8})
    scheduler = make_scheduler(connector=connector)
    prompt = list(range(13))
    request = make_request("a", prompt)
    scheduler.add_request(request)
    out = step(scheduler, model)
    assert out.connector_meta == {"num_requests": 1}
    assert connector.loaded == {"a": (0, 8)}
    assert out.start_positions == [8] and out.num_new_tokens == [5]
    assert request.num_cached_tokens == 8 and request.num_external_tokens == 8
    run(scheduler, model)
    assert request.output_token_ids == reference(prompt, 4)
    assert connector.finished == ["a"]
    assert_all_blocks_released(scheduler)


def test_connector_tokens_are_capped_to_leave_the_last_token():
    model = FakeModel()
    scheduler = make_scheduler(connector=FakeConnector(model, {"a": 100}))
    request = make_request("a", list(range(9)))
    scheduler.add_request(request)
    out = step(scheduler, model)
    assert out.start_positions == [8] and out.num_new_tokens == [1] and out.sample == [True]


def test_async_load_waits_while_others_run_then_computes_what_did_not_arrive():
    model = FakeModel()
    connector = FakeConnector(model, {"a": 12}, load_async=True)
    scheduler = make_scheduler(connector=connector, max_num_seqs=2)
    a = make_request("a", list(range(17)), max_tokens=3)
    b, c = make_request("b", [5, 6, 7], max_tokens=6), make_request("c", [8, 9], max_tokens=2)
    for request in (a, b, c):
        scheduler.add_request(request)
    for _ in range(2):
        out = step(scheduler, model)
        assert out.requests == [b], "the loading request holds a seat but is not scheduled"
        assert a.status == RequestStatus.WAITING_FOR_REMOTE_KV and len(scheduler.kv.get_blocks("a")) == 3
        assert scheduler.stats()["num_requests_loading_kv"] == 1
    connector.finish_load(a, delivered=8)  # only 2 of the 3 promised blocks arrived
    out = step(scheduler, model)
    assert out.requests[-1] is a and out.start_positions[-1] == 8 and out.num_new_tokens[-1] == 9
    assert a.num_external_tokens == 8 and a.num_cached_tokens == 8
    run(scheduler, model)
    for request in (a, b, c):
        assert request.output_token_ids == reference(request.prompt_token_ids, request.sampling_params.max_tokens)
    assert_all_blocks_released(scheduler)


def test_a_request_the_connector_cannot_answer_yet_waits_in_place_while_others_run():
    model = FakeModel()
    connector = FakeConnector(model, {"a": 8})
    scheduler = make_scheduler(connector=connector)
    a, b = make_request("a", list(range(13))), make_request("b", [5, 6, 7], max_tokens=6)
    connector.unknown.add("a")
    for request in (a, b):
        scheduler.add_request(request)
    out = step(scheduler, model)
    assert out.requests == [b] and a.status == RequestStatus.WAITING
    assert list(scheduler.waiting) == [a] and scheduler.num_loading == 1
    connector.answer(a)
    out = step(scheduler, model)
    assert a in out.requests and connector.loaded["a"] == (0, 8) and scheduler.num_loading == 0
    run(scheduler, model)
    for request in (a, b):
        assert request.output_token_ids == reference(request.prompt_token_ids, request.sampling_params.max_tokens)
    assert_all_blocks_released(scheduler)


def test_abort_while_loading_releases_the_blocks():
    model = FakeModel()
    connector = FakeConnector(model, {"a": 8}, load_async=True)
    scheduler = make_scheduler(connector=connector)
    scheduler.add_request(make_request("a", list(range(13))))
    assert scheduler.schedule().requests == []
    assert scheduler.has_unfinished_requests()
    scheduler.abort_requests(["a"])
    assert not scheduler.has_unfinished_requests()
    assert_all_blocks_released(scheduler)


def test_offload_mode_hands_the_victim_to_the_connector_before_freeing():
    model = FakeModel()
    connector = FakeConnector(model, {})
    config = EngineConfig(block_size=BS, max_num_batched_tokens=64, kv_offload="cpu")
    scheduler = Scheduler(config, KVCacheManager(7, BS), BlockHasher(b"fake-model", BS), connector)
    requests = [make_request(rid, [base + i for i in range(8)], 4) for rid, base in (("a", 0), ("b", 100), ("c", 200))]
    for request in requests:
        scheduler.add_request(request)
    step(scheduler, model)
    blocks_of_c = scheduler.kv.get_block_ids("c")
    out = step(scheduler, model)
    assert out.preempted == [requests[2]]
    assert connector.preempted == [("c", 8, blocks_of_c)]
    run(scheduler, model)
    for request in requests:
        assert request.output_token_ids == reference(request.prompt_token_ids, 4)


def test_recomputed_tokens_count_work_redone_after_preemption():
    model = FakeModel()
    scheduler = make_scheduler(num_blocks=7, connector=None)
    for rid, base in (("a", 0), ("b", 100), ("c", 200)):
        scheduler.add_request(make_request(rid, [base + i for i in range(8)], max_tokens=4))
    run(scheduler, model)
    stats = scheduler.stats()
    assert stats["num_preemptions_total"] == 1
    # "c" had computed its 8 prompt tokens; its tail block was evicted, so the resume
    # hits the first block and computes tokens 4..7 again.
    assert stats["num_recomputed_tokens"] == BS


def test_stats_names():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3]))
    assert scheduler.stats() == {
        "num_requests_running": 0,
        "num_requests_waiting": 1,
        "num_requests_loading_kv": 0,
        "num_preemptions_total": 0,
        "num_recomputed_tokens": 0,
        "prefix_cache_queries": 0,
        "prefix_cache_hits": 0,
        "kv_cache_usage_perc": 0.0,
    }
    scheduler.schedule()
    assert scheduler.num_running == 1 and scheduler.num_waiting == 0
    assert scheduler.stats()["kv_cache_usage_perc"] == pytest.approx(1 / 64)
