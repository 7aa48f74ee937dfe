"""Threading behaviour of AsyncEngine, against a scripted stand-in for LLMEngine.

The stand-in only emits one token per request per step; it exists to observe which
thread calls the engine, when steps run, and what happens on abort, overload, shutdown
and crashes. Everything about real generation is tested end to end in test_openai_api.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import aclosing

import pytest

from engine.async_engine import (
    IDLE_STATS_REFRESH_S,
    AsyncEngine,
    EngineClosedError,
    EngineDeadError,
    QueueCapacityError,
    QueueFullError,
)
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.streams import EngineJob, RequestGroup

pytestmark = pytest.mark.timeout(30)


class ScriptedEngine:
    """Emits token `i` at the i-th step of each request; records every calling thread."""

    def __init__(
        self, step_seconds: float = 0.002, fail_at_step: int | None = None, intra_op: IntraOpThreads | None = None
    ) -> None:
        self.step_seconds = step_seconds
        self.fail_at_step = fail_at_step
        self.intra_op = intra_op
        self.step_threads: list[int] = []  # the intra-op thread count each step ran with
        self.step_ends: list[float] = []
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.aborted: list[str] = []
        self.num_steps = 0
        self.num_polls = 0
        self.threads: set[int] = set()
        self.shut_down = False

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, request_id, prompt, params, cache_salt=None, arrival_time=None, group=None):
        self._touch()
        if prompt == "bad":
            raise ValueError("bad prompt")
        if request_id in self.requests:
            raise ValueError(f"duplicate {request_id}")
        self.requests[request_id] = ([], params.max_tokens)

    def abort_request(self, request_ids):
        self._touch()
        for request_id in request_ids:
            if self.requests.pop(request_id, None) is not None:
                self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        self.num_polls += 1
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self._touch()
        self.num_steps += 1
        if self.intra_op is not None:
            self.step_threads.append(self.intra_op.count)
        if self.fail_at_step == self.num_steps:
            raise RuntimeError("scheduler bug")
        time.sleep(self.step_seconds)
        self.step_ends.append(time.monotonic())
        outputs = []
        for request_id, (tokens, max_tokens) in list(self.requests.items()):
            tokens.append(len(tokens))
            finished = len(tokens) == max_tokens
            if finished:
                del self.requests[request_id]
            outputs.append(_output(request_id, tokens, finished))
        return outputs

    def stats(self) -> dict:
        self._touch()
        return {"num_requests_running": len(self.requests), "steps": self.num_steps}

    def shutdown(self) -> None:
        self._touch()
        self.shut_down = True


class IntraOpThreads:
    """A stand-in for torch's intra-op thread count, which must only change on the engine thread."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.setters: set[int] = set()

    def get(self) -> int:
        return self.count

    def set(self, count: int) -> None:
        self.setters.add(threading.get_ident())
        self.count = count


def _output(request_id: str, tokens: list[int], finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, "", list(tokens), "length" if finished else None)
    return RequestOutput(request_id, None, [1], [completion], finished, RequestMetrics(0.0),
                         new_token_ids=tokens[-1:])


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


async def _collect(engine: AsyncEngine, request_id: str, max_tokens: int, prompt="p") -> list[RequestOutput]:
    params = SamplingParams(max_tokens=max_tokens)
    return [out async for out in engine.generate(prompt, params, request_id)]


async def _until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def run(coro_fn, engine: ScriptedEngine, **options):
    """Run `coro_fn(async_engine)` on a fresh loop, then shut the engine down."""

    async def main():
        async_engine = AsyncEngine(engine, **options)
        try:
            return await coro_fn(async_engine)
        finally:
            await async_engine.shutdown(graceful=False)

    return asyncio.run(main())


def test_streams_every_output_and_only_the_engine_thread_touches_the_engine():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        return await asyncio.gather(*(_collect(ae, f"r{i}", 5 + i) for i in range(4)))

    results = run(scenario, engine)
    for i, outputs in enumerate(results):
        assert _tokens(outputs) == list(range(5 + i))  # outputs a busy loop read late are merged
        assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert len(engine.threads) == 1
    assert threading.get_ident() not in engine.threads


def test_slow_consumer_gets_merged_outputs_with_every_token():
    engine = ScriptedEngine(step_seconds=0.001)

    async def scenario(ae: AsyncEngine):
        outputs = []
        async for output in ae.generate("p", SamplingParams(max_tokens=50), "r"):
            outputs.append(output)
            await asyncio.sleep(0.02)  # several steps pass while this consumer sleeps
        return outputs

    outputs = run(scenario, engine)
    assert len(outputs) < 50 and outputs[-1].finished
    assert _tokens(outputs) == list(range(50))
    assert outputs[-1].outputs[0].token_ids == list(range(50))


def test_add_request_errors_reach_the_caller_unchanged():
    async def scenario(ae: AsyncEngine):
        with pytest.raises(ValueError, match="bad prompt"):
            await _collect(ae, "r", 3, prompt="bad")
        return ae.num_pending_requests

    assert run(scenario, ScriptedEngine()) == 0


def test_duplicate_id_does_not_abort_the_request_that_owns_it():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        first = asyncio.ensure_future(_collect(ae, "same", 30))
        await _until(lambda: "same" in engine.requests)
        with pytest.raises(ValueError, match="duplicate"):
            await _collect(ae, "same", 3)
        return await first

    assert _tokens(run(scenario, engine)) == list(range(30))
    assert engine.aborted == []


def test_consumer_that_stops_iterating_aborts_its_request():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        async with aclosing(ae.generate("p", SamplingParams(max_tokens=1000), "r")) as stream:
            async for output in stream:
                if len(output.outputs[0].token_ids) == 3:
                    break
        await _until(lambda: engine.aborted == ["r"])
        return ae.num_pending_requests

    assert run(scenario, engine) == 0
    assert not engine.requests


def test_cancelled_consumer_aborts_its_request():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        task = asyncio.ensure_future(_collect(ae, "r", 1000))
        await _until(lambda: engine.num_steps > 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await _until(lambda: engine.aborted == ["r"])

    run(scenario, engine)


def test_queue_bound_rejects_then_admits_again():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        running = [asyncio.ensure_future(_collect(ae, f"r{i}", 20)) for i in range(2)]
        await _until(lambda: ae.num_pending_requests == 2)
        with pytest.raises(QueueFullError):
            await _collect(ae, "over", 1)
        await asyncio.gather(*running)
        return await _collect(ae, "later", 2)

    assert _tokens(run(scenario, engine, max_pending_requests=2)) == [0, 1]


def _group(ae: AsyncEngine, name: str, prompts: list[str], max_tokens: int = 3) -> RequestGroup:
    jobs = [EngineJob(f"{name}-{i}", p, SamplingParams(max_tokens=max_tokens)) for i, p in enumerate(prompts)]
    return RequestGroup(ae, jobs, None)


def test_a_request_group_is_admitted_whole_or_not_at_all():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        running = [asyncio.ensure_future(_collect(ae, f"r{i}", 50)) for i in range(2)]
        await _until(lambda: ae.num_pending_requests == 2)
        with pytest.raises(QueueFullError):
            await _group(ae, "three", ["p"] * 3).start()  # 2 slots free: none taken
        refused = (ae.num_pending_requests, sorted(engine.requests), list(engine.aborted))
        with pytest.raises(QueueCapacityError):
            await _group(ae, "five", ["p"] * 5).start()  # more than the queue: never
        two = _group(ae, "two", ["p"] * 2)
        await two.start()
        outputs = await two.final_outputs()
        await two.aclose()
        await asyncio.gather(*running)
        return refused, outputs, ae.num_pending_requests

    refused, outputs, pending_after = run(scenario, engine, max_pending_requests=4)
    assert refused == (2, ["r0", "r1"], [])  # no request of the refused group ever ran
    assert [o.finished for o in outputs] == [True, True] and pending_after == 0


def test_a_group_failing_at_admission_returns_every_slot():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        group = _group(ae, "g", ["p", "bad", "p", "p"], max_tokens=1000)
        with pytest.raises(ValueError, match="bad prompt"):
            await group.start()
        await group.aclose()
        await _until(lambda: not engine.requests)
        return ae.num_pending_requests

    assert run(scenario, engine, max_pending_requests=4) == 0


def test_idle_engine_thread_blocks_instead_of_spinning():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        await _collect(ae, "r", 3)
        await asyncio.sleep(0.05)
        polls_before = engine.num_polls
        await asyncio.sleep(0.3)
        return polls_before, engine.num_polls

    polls_before, polls_after = run(scenario, engine)
    assert polls_after == polls_before
    assert engine.num_steps == 3


def test_stats_snapshot_is_published_after_steps_and_read_only():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        await _collect(ae, "r", 4)
        await _until(lambda: ae.stats.get("steps") == 4)
        with pytest.raises(TypeError):
            ae.stats["steps"] = 0  # type: ignore[index]

    run(scenario, engine)


def test_stats_that_change_while_idle_are_republished():
    """The store works on between steps (a write behind the last request): an idle
    engine thread publishes its stats again, without polling for work."""
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        await _collect(ae, "r", 2)
        await _until(lambda: ae.stats.get("steps") == 2)
        polls = engine.num_polls
        engine.num_steps = 7  # what a background write would move
        await _until(lambda: ae.stats.get("steps") == 7, timeout=4 * IDLE_STATS_REFRESH_S)
        return polls, engine.num_polls

    polls_before, polls_after = run(scenario, engine)
    assert polls_after == polls_before


def test_call_runs_on_the_engine_thread_and_raises_its_errors():
    engine = ScriptedEngine()

    async def scenario(ae: AsyncEngine):
        ident = await ae.call(lambda e: threading.get_ident())
        with pytest.raises(KeyError):
            await ae.call(lambda e: {}["missing"])
        return ident

    assert run(scenario, engine) in engine.threads
    assert len(engine.threads) == 1


def test_graceful_shutdown_finishes_in_flight_requests_and_refuses_new_ones():
    engine = ScriptedEngine()

    async def scenario():
        ae = AsyncEngine(engine)
        request = asyncio.ensure_future(_collect(ae, "r", 40))
        await _until(lambda: engine.num_steps > 2)
        shutdown = asyncio.ensure_future(ae.shutdown(graceful=True, timeout=10))
        await asyncio.sleep(0)
        with pytest.raises(EngineClosedError):
            await _collect(ae, "late", 1)
        outputs = await request
        await shutdown
        return outputs

    outputs = asyncio.run(scenario())
    assert _tokens(outputs) == list(range(40)) and outputs[-1].finished
    assert engine.aborted == [] and engine.shut_down


def test_hard_shutdown_aborts_in_flight_requests():
    engine = ScriptedEngine()

    async def scenario():
        ae = AsyncEngine(engine)
        request = asyncio.ensure_future(_collect(ae, "r", 10_000))
        await _until(lambda: engine.num_steps > 2)
        await ae.shutdown(graceful=False)
        with pytest.raises(EngineClosedError):
            await request

    asyncio.run(scenario())
    assert engine.aborted == ["r"] and engine.shut_down


def test_engine_crash_fails_waiting_requests_and_later_ones():
    engine = ScriptedEngine(fail_at_step=3)

    async def scenario(ae: AsyncEngine):
        with pytest.raises(EngineDeadError):
            await _collect(ae, "r", 100)
        assert not ae.is_healthy
        with pytest.raises(EngineDeadError):
            await _collect(ae, "next", 1)
        with pytest.raises(EngineDeadError):
            await ae.call(lambda e: None)

    run(scenario, engine)


def test_an_engine_built_by_a_function_is_built_on_the_engine_thread():
    """Building runs on the thread that steps afterwards (every torch op of a server on one
    thread), and the constructor returns the built engine."""
    built_on: list[int] = []

    def build() -> ScriptedEngine:
        built_on.append(threading.get_ident())
        return ScriptedEngine()

    async def scenario():
        ae = AsyncEngine(build)
        try:
            outputs = await _collect(ae, "r", 3)
            return ae.engine, outputs
        finally:
            await ae.shutdown(graceful=False)

    engine, outputs = asyncio.run(scenario())
    # outputs the reader has not taken yet are merged: count tokens, not outputs
    assert [t for o in outputs for t in o.new_token_ids] == list(range(3)) and outputs[-1].finished
    assert engine.threads == set(built_on) and built_on[0] != threading.get_ident()


def test_an_engine_that_fails_to_build_raises_from_the_constructor():
    def build() -> ScriptedEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(build)


def _lending(threads: IntraOpThreads, step_seconds: float = 0.002) -> tuple[ScriptedEngine, dict]:
    engine = ScriptedEngine(step_seconds=step_seconds, intra_op=threads)
    return engine, {"intra_op_threads": (threads.get, threads.set)}


def test_a_lent_core_runs_the_steps_on_one_thread_fewer_until_it_is_given_back():
    threads = IntraOpThreads(4)
    engine, options = _lending(threads)

    async def scenario(ae: AsyncEngine):
        task = asyncio.ensure_future(_collect(ae, "r", 100_000))
        await _until(lambda: engine.num_steps > 2)
        async with ae.lend_core():
            assert threads.count == 3  # lowered before the block is entered
            first = engine.num_steps
            await _until(lambda: engine.num_steps > first + 3)
            during = engine.step_threads[first:]
        await _until(lambda: threads.count == 4)
        after = engine.num_steps
        await _until(lambda: engine.num_steps > after + 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return during, engine.step_threads[after + 1:]

    during, after = run(scenario, engine, **options)
    assert set(during) == {3}
    assert set(after) == {4}
    assert threads.setters == engine.threads  # set on the engine thread only


def test_a_loan_is_entered_at_a_step_boundary_not_mid_step():
    threads = IntraOpThreads(2)
    engine, options = _lending(threads, step_seconds=0.2)

    async def scenario(ae: AsyncEngine):
        task = asyncio.ensure_future(_collect(ae, "r", 3))
        await _until(lambda: engine.num_steps == 1)
        async with ae.lend_core():
            entered = time.monotonic()
            await task
        return entered

    entered = run(scenario, engine, **options)
    assert entered >= engine.step_ends[0]  # the step in flight finished first
    assert engine.step_threads == [2, 1, 1]


def test_loans_at_once_leave_the_engine_one_thread_and_all_come_back():
    threads = IntraOpThreads(3)
    engine, options = _lending(threads)

    async def borrow(ae: AsyncEngine, seen: list[int]) -> None:
        async with ae.lend_core():
            seen.append(threads.count)
            await asyncio.sleep(0.05)

    async def scenario(ae: AsyncEngine):
        seen: list[int] = []
        await asyncio.gather(*(borrow(ae, seen) for _ in range(4)))
        await _until(lambda: threads.count == 3)
        return seen

    seen = run(scenario, engine, **options)
    assert min(seen) == 1 and all(1 <= count <= 2 for count in seen)


def test_a_loan_cancelled_while_waiting_is_given_back():
    threads = IntraOpThreads(2)
    engine, options = _lending(threads, step_seconds=0.1)

    async def scenario(ae: AsyncEngine):
        stream = asyncio.ensure_future(_collect(ae, "r", 1000))
        await _until(lambda: engine.num_steps == 1)

        async def borrow():
            async with ae.lend_core():
                raise AssertionError("entered a cancelled loan")

        waiting = asyncio.ensure_future(borrow())
        await asyncio.sleep(0.01)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        first = engine.num_steps
        await _until(lambda: engine.num_steps > first + 2)
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
        return waiting.cancelled()

    assert run(scenario, engine, **options)
    assert threads.count == 2 and engine.step_threads[-1] == 2


def test_a_closed_engine_lends_nothing_and_does_not_block():
    threads = IntraOpThreads(2)
    engine, options = _lending(threads)

    async def scenario(ae: AsyncEngine):
        await ae.shutdown(graceful=False)
        async with ae.lend_core():
            return threads.count

    assert run(scenario, engine, **options) == 2
