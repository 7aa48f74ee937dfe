"""The engine requests behind one API call, and client-disconnect handling.

A completion with several prompts runs one engine request per prompt. `RequestGroup`
starts them together (so admission errors surface before any response byte is sent),
merges their outputs, and aborts whatever is still running when it is closed. They take
a queue slot per sequence (prompts x n) and share one group in the scheduler's fair
admission (engine/scheduler.py), so one call cannot hold the batch while others wait.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from starlette.requests import Request

from engine.async_engine import AsyncEngine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

T = TypeVar("T")


@dataclass
class EngineJob:
    """One engine request: the prompt's token ids and its sampling parameters."""

    request_id: str
    token_ids: list[int]
    params: SamplingParams


class ClientDisconnectedError(Exception):
    """The client went away before the response was ready."""


class RequestGroup:
    """The engine requests of one API call (one per prompt), started and closed together."""

    def __init__(self, engine: AsyncEngine, jobs: list[EngineJob], cache_salt: str | None) -> None:
        self._engine = engine
        self._jobs = jobs
        self._cache_salt = cache_salt
        self._generators: list[AsyncGenerator[RequestOutput, None]] = []
        self._firsts: list[RequestOutput] = []

    def __len__(self) -> int:
        """The number of engine requests (prompts) of the call."""
        return len(self._jobs)

    async def start(self) -> None:
        """Admit every request and wait for each one's first output. The queue slots of
        all of their sequences are taken first, at once: a full queue refuses the group
        before any request runs. Raises the first admission error (queue full, prompt too
        long, ...) after aborting the others."""
        reservation = self._engine.reserve(sum(job.params.n for job in self._jobs))
        group = self._jobs[0].request_id  # the group is named after its first request
        self._generators = [
            self._engine.generate(job.token_ids, job.params, job.request_id, self._cache_salt, reservation, group)
            for job in self._jobs
        ]
        try:
            self._firsts = await _gather_or_cancel([anext(g) for g in self._generators])
        finally:
            reservation.release_unused()  # the slots of requests that never started

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(index, output) of every request as produced, the started outputs first."""
        for index, first in enumerate(self._firsts):
            yield index, first
        pending = [i for i, first in enumerate(self._firsts) if not first.finished]
        if len(pending) == 1:
            async for output in self._generators[pending[0]]:
                yield pending[0], output
        elif pending:
            async for item in _merge({i: self._generators[i] for i in pending}):
                yield item

    async def final_outputs(self) -> list[RequestOutput]:
        """Run every request to the end; the last output of each, in job order."""
        last = list(self._firsts)
        async for index, output in self.outputs():
            last[index] = output
        return last

    async def aclose(self) -> None:
        """Abort the requests still running."""
        for generator in self._generators:
            await generator.aclose()


async def _gather_or_cancel(awaitables: list[Awaitable[T]]) -> list[T]:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


_DONE = object()


async def _merge(streams: dict[int, AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleave several async iterators as their items arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((index, exc))
        await queue.put((index, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in streams.items()]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting its engine requests) if the client
    disconnects first. Streaming responses get this from Starlette already."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        disconnected = not task.done()
        if disconnected:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if disconnected:
        raise ClientDisconnectedError
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
