"""AsyncEngine: the synchronous LLMEngine driven by one dedicated thread, for asyncio callers.

The LLMEngine is not thread-safe, so exactly one thread (the engine thread) ever touches
it. Callers talk to that thread through a thread-safe inbox of commands (add, abort, call,
stop); the thread loops `step()` while work exists and blocks on the inbox when idle. It
routes each step's outputs to the callers' event loops with `call_soon_threadsafe`, one
callback per loop per step, into one mailbox per request. A mailbox holds at most one
output: outputs a slow consumer has not read yet are merged (they are cumulative, and
their `new_token_ids` deltas are concatenated), so memory stays bounded per request.

Ownership: the request -> stream map is read and written by the engine thread only; the
event-loop side only counts admitted sequences (for the queue bound) under a lock: a
request with n > 1 runs n sequences and takes n slots, since the bound is what the
engine's batch and waiting queue hold (one slot per request let 8 prompts x n=128 past a
bound of 320). A group of requests (the prompts of one API call) takes its slots at once
with `reserve`, so it is admitted whole or not at all, and shares one `group` in the
scheduler's fair admission.

Lent cores. The engine's torch ops use every core through an OpenMP team. Other CPU work
in the process (decoding a body of megabytes, tokenizing a long text) takes a core from
that team in the middle of a parallel region, and every region then waits at its barrier
for the descheduled member: a decode step of a few tens of milliseconds stretches to
hundreds, and every stream stalls. So such work borrows a core instead (`lend_core`): the
engine thread lowers its intra-op threads by one between two steps, says so, and the work
runs on the freed core while the engine steps on the others; the core goes back when the
last loan ends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol, TypeVar

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
_DRAIN_POLL_S = 0.01
# How often an idle engine thread republishes the engine's stats.
IDLE_STATS_REFRESH_S = 0.5


class QueueFullError(RuntimeError):
    """More sequences are in flight than the engine admits; retry later."""


class QueueCapacityError(ValueError):
    """More sequences at once than the queue bound itself: they could never be admitted."""


class EngineClosedError(RuntimeError):
    """The engine is shutting down: it accepts no new work and aborts what is left."""


class EngineDeadError(RuntimeError):
    """The engine thread crashed; nothing more will run."""


class SyncEngine(Protocol):
    """The part of LLMEngine that the engine thread drives."""

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams,
        cache_salt: str | None = None, arrival_time: float | None = None, group: str | None = None,
    ) -> Any: ...

    def abort_request(self, request_ids: list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def stats(self) -> dict: ...

    def shutdown(self) -> None: ...


class StepObserver(Protocol):
    """Sees every step's outputs and every abort, on the engine thread (e.g. metrics)."""

    def on_outputs(self, outputs: list[RequestOutput], now: float) -> None: ...

    def on_aborted(self, request_ids: list[str]) -> None: ...


@dataclass(eq=False)
class _Stream:
    """The mailbox of one request, used on the caller's event loop only."""

    loop: asyncio.AbstractEventLoop
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    latest: RequestOutput | None = None
    error: BaseException | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self.error = item
        elif self.latest is None:
            self.latest = item
        else:
            new_ids = [*self.latest.new_token_ids, *item.new_token_ids]
            self.latest = dataclasses.replace(item, new_token_ids=new_ids)
        self.ready.set()

    async def get(self) -> RequestOutput:
        """The next (possibly merged) output; raises the error delivered after it."""
        await self.ready.wait()
        if self.latest is None:
            raise self.error
        output, self.latest = self.latest, None
        if self.error is None:
            self.ready.clear()
        return output


class Reservation:
    """Sequence slots taken at once (`AsyncEngine.reserve`). Each request started with it
    uses a slot per sequence, which that request returns when it ends; `release_unused`
    returns the slots no request took."""

    def __init__(self, engine: AsyncEngine, count: int) -> None:
        self._engine = engine
        self.unused = count

    def take(self, count: int) -> None:
        if count > self.unused:
            raise RuntimeError(f"{count} slots asked, {self.unused} left in this reservation")
        self.unused -= count

    def release_unused(self) -> None:
        self._engine._release_slots(self.unused)
        self.unused = 0


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None
    arrival_time: float
    group: str | None
    stream: _Stream
    ack: asyncio.Future


@dataclass
class _Abort:
    request_id: str
    stream: _Stream  # abort only if this stream still owns the id (never a namesake)


@dataclass
class _Call:
    fn: Callable[[Any], Any]
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future


@dataclass
class _Stop:
    pass


@dataclass
class _Lend:
    """Lend one core more (+1) or take one back (-1); `ack` is settled once applied."""

    delta: int
    loop: asyncio.AbstractEventLoop | None = None
    ack: asyncio.Future | None = None


_Command = _Add | _Abort | _Call | _Stop | _Lend


class AsyncEngine:
    """Owns the engine thread. `max_pending_requests` bounds the sequences (n per request)
    admitted and not yet finished (None: unbounded); beyond it `generate` raises
    QueueFullError.

    `engine` may be a function that builds it: it then runs on the engine thread, and the
    constructor returns once it has (raising what it raised). A server builds its engine
    so that every torch op of the process runs on one thread: OpenMP keeps a thread team
    per thread that has run a parallel region, and once a process holds more OpenMP
    threads than cores, libgomp's workers stop spinning between regions and sleep, so
    every op then waits for a wake-up, a large share of a small decode step.

    `intra_op_threads` is the (get, set) pair of the engine's intra-op thread count
    (torch.get_num_threads, torch.set_num_threads), called on the engine thread only;
    without it `lend_core` lends nothing."""

    def __init__(
        self,
        engine: SyncEngine | Callable[[], SyncEngine],
        *,
        max_pending_requests: int | None = None,
        observer: StepObserver | None = None,
        thread_name: str = "kvtier-engine",
        intra_op_threads: tuple[Callable[[], int], Callable[[int], None]] | None = None,
    ) -> None:
        self._engine: SyncEngine | None = None if callable(engine) else engine
        self._observer = observer
        self._max_pending = max_pending_requests
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._accepting = True
        self._closed = False  # set once the engine thread stops reading the inbox
        self._submit_lock = threading.Lock()
        self._error: BaseException | None = None
        self._stats: Mapping[str, Any] = MappingProxyType({})
        self._intra_op_threads = intra_op_threads
        self._full_threads = 0  # the engine's own thread count, read on the engine thread
        self._cores_lent = 0  # loans out; engine thread only
        built = threading.Event()
        build = engine if callable(engine) else None
        self._thread = threading.Thread(target=self._run, args=(build, built), name=thread_name, daemon=True)
        self._thread.start()
        built.wait()
        if self._engine is None:
            raise self._error  # what building the engine raised

    @property
    def engine(self) -> SyncEngine:
        """The engine, for reading what it was built with (config, spec, tokenizer);
        everything else goes through `call`."""
        return self._engine

    # ---- event-loop side ------------------------------------------------------------------

    @property
    def stats(self) -> Mapping[str, Any]:
        """The engine's stats as published after its latest step (read-only snapshot)."""
        return self._stats

    @property
    def num_pending_requests(self) -> int:
        """Sequences admitted and not finished (a request with n > 1 counts n)."""
        return self._pending

    @property
    def is_healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        cache_salt: str | None = None,
        reservation: Reservation | None = None,
        group: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until the finished one. Errors of `add_request`
        are raised here unchanged; stopping the iteration (a client gone, a cancelled
        task) aborts the request on the engine. The request takes a slot per sequence
        (`params.n`) from `reservation`, else it reserves them (QueueFullError when too
        few are free); `group` is add_request's."""
        (reservation or self.reserve(params.n)).take(params.n)
        loop = asyncio.get_running_loop()
        stream = _Stream(loop)
        done = False
        try:
            ack = loop.create_future()
            self._submit(_Add(request_id, prompt, params, cache_salt, time.monotonic(), group, stream, ack))
            try:
                await ack
            except BaseException:
                done = ack.done() and not ack.cancelled()  # rejected by add_request: nothing to abort
                raise
            while not done:
                try:
                    output = await stream.get()
                except (EngineClosedError, EngineDeadError):
                    done = True
                    raise
                done = output.finished
                yield output
        finally:
            self._release_slots(params.n)
            if not done:
                self._submit(_Abort(request_id, stream))

    async def call(self, fn: Callable[[Any], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps and return its result
        (or raise its exception): the only safe way to touch the engine from outside."""
        self._check_usable()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._submit(_Call(fn, loop, future))
        return await future

    @asynccontextmanager
    async def lend_core(self) -> AsyncIterator[None]:
        """Borrow one of the engine's cores for CPU-heavy work of the caller's (see the
        module docstring): entered once the engine steps on one intra-op thread fewer
        (at its next step boundary; at once when it is idle), left by giving it back. The
        engine keeps one thread however many loans are out; a closed engine lends nothing
        and the block runs at once."""
        loop = asyncio.get_running_loop()
        ack = loop.create_future()
        if not self._submit(_Lend(+1, loop, ack)):
            yield
            return
        try:
            await ack
            yield
        finally:
            self._submit(_Lend(-1))

    async def shutdown(self, graceful: bool = True, timeout: float = 30.0) -> None:
        """Stop accepting; if graceful, let in-flight requests finish for up to `timeout`
        seconds; abort the rest and stop the engine thread."""
        self._accepting = False
        if graceful:
            deadline = time.monotonic() + timeout
            while self._pending and self.is_healthy and time.monotonic() < deadline:
                await asyncio.sleep(_DRAIN_POLL_S)
        self._submit(_Stop())
        await asyncio.to_thread(self._thread.join)

    def _check_usable(self) -> None:
        if self._error is not None or not self._accepting:
            raise self._closed_error()

    def _closed_error(self) -> RuntimeError:
        if self._error is not None:
            return EngineDeadError(f"the engine failed: {self._error!r}")
        return EngineClosedError("the engine is shutting down")

    def _submit(self, command: _Command) -> bool:
        """Queue a command unless the engine thread has stopped reading (aborts, stops and
        loans are then moot: False; anything else is refused, never left unanswered)."""
        with self._submit_lock:
            if not self._closed:
                self._inbox.put(command)
                return True
        if not isinstance(command, _Abort | _Stop | _Lend):
            raise self._closed_error()
        return False

    def reserve(self, count: int) -> Reservation:
        """Take `count` sequence slots at once, or none: QueueFullError while fewer are
        free, QueueCapacityError if `count` exceeds the bound itself."""
        self._check_usable()
        with self._pending_lock:
            if self._max_pending is not None:
                if count > self._max_pending:
                    raise QueueCapacityError(
                        f"{count} sequences at once can never be admitted: the server holds at most "
                        f"{self._max_pending}"
                    )
                if self._pending + count > self._max_pending:
                    raise QueueFullError(
                        f"the server is busy: {self._pending} sequences in flight (limit "
                        f"{self._max_pending}), {count} more asked"
                    )
            self._pending += count
        return Reservation(self, count)

    def _release_slots(self, count: int) -> None:
        with self._pending_lock:
            self._pending -= count

    # ---- engine thread --------------------------------------------------------------------

    def _run(self, build: Callable[[], SyncEngine] | None, built: threading.Event) -> None:
        if build is not None:
            try:
                self._engine = build()
            except Exception as exc:  # the constructor raises it
                self._error = exc
                built.set()
                return
        built.set()
        try:
            self._serve()
        except Exception as exc:  # a crash must reach every waiting caller, not vanish
            logger.exception("the engine thread crashed")
            self._error = exc
            self._close(self._closed_error())
            return
        self._abort_all()
        self._close(EngineClosedError("aborted: the server is shutting down"))
        self._engine.shutdown()  # writes out pending store saves

    def _serve(self) -> None:
        """Apply commands and step until a stop command arrives."""
        self._publish_stats()
        while True:
            busy = self._engine.has_unfinished_requests()
            commands = self._take_commands(block=not busy)
            for command in commands:
                self._apply(command)
            if any(isinstance(c, _Stop) for c in commands):
                return
            if self._engine.has_unfinished_requests():
                self._route(self._engine.step())
            self._publish_stats()

    def _publish_stats(self) -> None:
        """Replace the snapshot readers see (a fresh dict: never mutated once published)."""
        self._stats = MappingProxyType(dict(self._engine.stats()))

    def _take_commands(self, block: bool) -> list[_Command]:
        """All queued commands; when idle, wait (without spinning) for at least one,
        republishing the stats every IDLE_STATS_REFRESH_S meanwhile: the store goes on
        between steps (writes behind the last request finish, other instances' records
        are found), and a scrape of an idle server must see it."""
        commands = []
        while block and not commands:
            try:
                commands.append(self._inbox.get(timeout=IDLE_STATS_REFRESH_S))
            except queue.Empty:
                self._publish_stats()
        while True:
            try:
                commands.append(self._inbox.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Command) -> None:
        if isinstance(command, _Add):
            self._add(command)
        elif isinstance(command, _Abort):
            self._abort(command)
        elif isinstance(command, _Call):
            self._call(command)
        elif isinstance(command, _Lend):
            self._lend(command)

    def _lend(self, command: _Lend) -> None:
        self._cores_lent += command.delta
        if self._intra_op_threads is not None:
            get_threads, set_threads = self._intra_op_threads
            if self._cores_lent == 1 and command.delta > 0:
                self._full_threads = get_threads()  # what the engine runs on while nothing is lent
            threads = max(1, self._full_threads - self._cores_lent)
            if get_threads() != threads:
                set_threads(threads)
        if command.ack is not None:
            _post(command.loop, _settle, command.ack, None, None)

    def _add(self, command: _Add) -> None:
        try:
            self._engine.add_request(
                command.request_id, command.prompt, command.params,
                cache_salt=command.cache_salt, arrival_time=command.arrival_time, group=command.group,
            )
        except Exception as exc:  # add_request's errors belong to the caller, unchanged
            _post(command.stream.loop, _settle, command.ack, None, exc)
            return
        self._streams[command.request_id] = command.stream
        _post(command.stream.loop, _settle, command.ack, None, None)

    def _abort(self, command: _Abort) -> None:
        if self._streams.get(command.request_id) is not command.stream:
            return
        del self._streams[command.request_id]
        self._engine.abort_request([command.request_id])
        self._notify_aborted([command.request_id])

    def _call(self, command: _Call) -> None:
        try:
            result = command.fn(self._engine)
        except Exception as exc:  # the caller's function failed: its caller gets the error
            _post(command.loop, _settle, command.future, None, exc)
            return
        _post(command.loop, _settle, command.future, result, None)

    def _route(self, outputs: list[RequestOutput]) -> None:
        """Hand each output to its stream: one loop callback per event loop per step."""
        if self._observer is not None and outputs:
            self._observe(outputs)
        batches: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = defaultdict(list)
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            batches[stream.loop].append((stream, output))
        for loop, items in batches.items():
            if not _post(loop, _deliver, items):
                self._drop_orphans([item[0] for item in items])

    def _observe(self, outputs: list[RequestOutput]) -> None:
        try:
            self._observer.on_outputs(outputs, time.monotonic())
        except Exception:  # metrics must never take the engine down
            logger.exception("the step observer failed")

    def _notify_aborted(self, request_ids: list[str]) -> None:
        if self._observer is None or not request_ids:
            return
        try:
            self._observer.on_aborted(request_ids)
        except Exception:  # metrics must never take the engine down
            logger.exception("the step observer failed")

    def _drop_orphans(self, streams: list[_Stream]) -> None:
        """Abort the requests whose caller's event loop has closed: nobody reads them."""
        orphans = [rid for rid, s in self._streams.items() if s in streams]
        for rid in orphans:
            del self._streams[rid]
        self._engine.abort_request(orphans)
        self._notify_aborted(orphans)

    def _abort_all(self) -> None:
        ids = list(self._streams)
        self._engine.abort_request(ids)
        self._notify_aborted(ids)
        self._publish_stats()

    def _close(self, error: RuntimeError) -> None:
        """Stop reading the inbox: answer what is queued and every open stream with `error`."""
        with self._submit_lock:
            self._closed = True
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(command, _Add):
                _post(command.stream.loop, _settle, command.ack, None, error)
            elif isinstance(command, _Call):
                _post(command.loop, _settle, command.future, None, error)
            elif isinstance(command, _Lend) and command.ack is not None:
                _post(command.loop, _settle, command.ack, None, None)  # nothing left to lend from
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            _post(stream.loop, _deliver, [(stream, error)])


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> bool:
    """Schedule `fn(*args)` on `loop` from another thread; False if the loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():  # the waiter was cancelled meanwhile
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _deliver(items: list[tuple[_Stream, Any]]) -> None:
    for stream, item in items:
        stream.put(item)
