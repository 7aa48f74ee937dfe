"""The store's I/O runtime: an asyncio loop in a daemon thread it owns.

The engine is synchronous; it hands work to this loop and gets concurrent.futures back.
Long-running workers (write-behind writers, the Redis probe) run under a supervisor: a
worker that raises is logged, counted in `restarts` and started again after a short,
growing delay, so it is never silently gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

RESTART_DELAY_S = 0.05
MAX_RESTART_DELAY_S = 5.0


def resolved(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_running_or_notify_cancel()
    future.set_result(value)
    return future


def pending_future() -> Future[Any]:
    """A future the caller cannot cancel: the store resolves it when it is done with
    the caller's buffers, never earlier."""
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()
    return future


class IoRuntime:
    def __init__(self, name: str = "kvstore-io") -> None:
        self.loop = asyncio.new_event_loop()
        self._restarts: Counter[str] = Counter()
        self._restarts_lock = threading.Lock()
        self._tasks: set[asyncio.Task] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def restarts(self) -> dict[str, int]:
        """How many times each supervised worker crashed and was restarted."""
        with self._restarts_lock:
            return dict(self._restarts)

    def in_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run `coro` on the loop and wait for it; raises TimeoutError after `timeout`."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError("blocking store call from the store's own I/O thread")
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` as a tracked task (cancelled at close); callable from any thread."""
        self.loop.call_soon_threadsafe(self.task, coro)

    def task(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        """`coro` as a tracked task (cancelled at close); call it on the loop's thread."""
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def supervise(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        self.spawn(self._supervised(name, factory))

    def cancel_tasks(self, timeout: float = 5.0) -> None:
        """Cancel every tracked task (workers, loads, prefetches) and wait for them."""
        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):
                self.call(self._cancel_all(), timeout)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and join the thread."""
        if not self._thread.is_alive():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    async def _supervised(self, name: str, factory: Callable[[], Awaitable[None]]) -> None:
        delay = RESTART_DELAY_S
        while True:
            try:
                await factory()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                with self._restarts_lock:
                    self._restarts[name] += 1
                log.exception("kvstore worker %s crashed; restarting it", name)
            await asyncio.sleep(delay)
            delay = min(delay * 2, MAX_RESTART_DELAY_S)

    async def _cancel_all(self) -> None:
        current = asyncio.current_task()
        tasks = [t for t in self._tasks if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
