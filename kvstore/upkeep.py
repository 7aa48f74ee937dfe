"""The store's one background thread: periodic upkeep and one-off jobs.

Periodic steps (populating host slots ahead of use, probing Redis, rescanning a disk
directory) each do a short piece of work and say when they want to run again; one-off
jobs (a flush, a probe the admin asked for) come with a future. A step that raises is
logged, counted in `restarts` and run again after a short, growing delay, so it is
never silently gone. Nothing here is on a request's path: loads and saves run on the
store's read and write pools.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)

RESTART_DELAY_S = 0.05
MAX_RESTART_DELAY_S = 5.0

Step = Callable[[], float | None]  # one piece of work; seconds until the next, None: done


class Upkeep:
    def __init__(self, name: str = "kvstore-upkeep") -> None:
        self._cond = threading.Condition()
        self._jobs: deque[tuple[Callable[[], Any], Future[Any]]] = deque()
        self._due: list[tuple[float, int, str, Step, float]] = []  # (when, order, name, step, retry delay)
        self._order = itertools.count()
        self._restarts: Counter[str] = Counter()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def every(self, name: str, step: Step, first_in_s: float = 0.0) -> None:
        """Run `step` in `first_in_s`, then whenever it asks, until it answers None."""
        with self._cond:
            heapq.heappush(self._due, (time.monotonic() + first_in_s, next(self._order), name, step, RESTART_DELAY_S))
            self._cond.notify()

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run `job` once, before the periodic steps that are due; cancelling the future
        before it starts skips it."""
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the store's upkeep thread is stopped")
            self._jobs.append((job, future))
            self._cond.notify()
        return future

    def restarts(self) -> dict[str, int]:
        """How many times each periodic step raised and was run again."""
        with self._cond:
            return dict(self._restarts)

    def close(self, timeout_s: float) -> None:
        """Stop after the job or step under way; jobs not started are cancelled."""
        with self._cond:
            self._closed = True
            jobs, self._jobs = list(self._jobs), deque()
            self._cond.notify()
        for _, future in jobs:
            future.cancel()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                work = self._next_locked()
                if work is None:
                    return
            work()

    def _next_locked(self) -> Callable[[], None] | None:
        """The next thing to do, waiting for it; None once closed."""
        while not self._closed:
            if self._jobs:
                job, future = self._jobs.popleft()
                return lambda: self._run_job(job, future)
            now = time.monotonic()
            if self._due and self._due[0][0] <= now:
                _, _, name, step, delay = heapq.heappop(self._due)
                return lambda: self._run_step(name, step, delay)
            self._cond.wait(self._due[0][0] - now if self._due else None)
        return None

    def _run_job(self, job: Callable[[], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(job())
        except Exception as exc:
            future.set_exception(exc)

    def _run_step(self, name: str, step: Step, delay: float) -> None:
        try:
            again = step()
        except Exception:
            with self._cond:
                self._restarts[name] += 1
            log.exception("kvstore upkeep %s failed; running it again", name)
            again, delay = delay, min(delay * 2, MAX_RESTART_DELAY_S)
        else:
            delay = RESTART_DELAY_S
        if again is None:
            return
        with self._cond:
            heapq.heappush(self._due, (time.monotonic() + again, next(self._order), name, step, delay))
