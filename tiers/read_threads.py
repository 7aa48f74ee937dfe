"""The threads that read records a request waits for, apart from the store's other work.

A record tier runs its blocking calls in threads. `asyncio.to_thread` sends them all to
the I/O loop's default executor, which has min(32, cpus + 4) threads: 6 on a 2-core
machine. Background work runs there too (sealing and writing saved records, Redis puts,
populating cpu slots, directory rescans), so a load's concurrent parts queued behind
writes in flight, and even with nothing else running, a load's 8th part waited for one
of the first 6 to finish. Reads go to a pool of their own, shared by every store of the
process; a child the process forks starts a pool of its own (the parent's threads do
not exist there).
"""

from __future__ import annotations

import asyncio
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# At least the parts a load is read in at once (kvstore.loading.READ_PARTS).
READ_THREADS = 8

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _read_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvstore-read")
        return _pool


def _forget_pool_in_child() -> None:
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)


async def in_read_thread(read: Callable[..., T], *args: object) -> T:
    """`read(*args)` on a read thread, awaited from the running loop."""
    return await asyncio.get_running_loop().run_in_executor(_read_pool(), functools.partial(read, *args))
