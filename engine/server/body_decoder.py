"""The thread that decodes big request bodies, and the resident memory it decodes them in.

Decoding a body of several MB holds the GIL for one C call (json.loads), and every stream
the server is sending waits that long. Most of that call is not parsing but first touches
of fresh memory: the decoded text (one to four bytes per character, and the parser's
growing buffer besides) lands in pages the C allocator has just mapped, and each first
touch of a page is a page fault, several microseconds apiece on a virtual machine; an 8 MB
body touches about 30 MB. glibc's malloc maps blocks this big afresh and unmaps them when
freed, so every big body paid for all of its pages again.

So one thread decodes every big body, and its memory stays resident: at start the thread
touches `reserve_bytes` of its malloc arena and frees it, and `keep_freed_memory` tells
glibc to serve blocks up to MMAP_THRESHOLD from arenas and to keep up to TRIM_THRESHOLD
of freed memory instead of giving it back to the system. A body then decodes in memory
that is already mapped. Elsewhere than glibc nothing is tuned and bodies decode as before.

The thread decodes inside a core the engine lends (`AsyncEngine.lend_core`), so that it
does not take a core from the engine's OpenMP team mid-step.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractAsyncContextManager, nullcontext
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
# Blocks up to this size come from malloc's arenas (glibc's largest allowed value on 64-bit).
MMAP_THRESHOLD = 32 * 1024**2
# Free memory a malloc heap keeps before it gives some back to the system.
TRIM_THRESHOLD = 64 * 1024**2
# Decoding a body of n bytes writes up to about this many times n bytes of new objects.
RESERVE_PER_BODY_BYTE = 4
# A thread's malloc heap spans at most 64 MiB on 64-bit glibc; a reserve beyond one heap
# would not serve a single block.
MAX_RESERVE_BYTES = 48 * 1024**2
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def reserve_for(max_body_bytes: int) -> int:
    """The resident memory that decoding bodies of up to `max_body_bytes` needs."""
    return min(RESERVE_PER_BODY_BYTE * max_body_bytes, MAX_RESERVE_BYTES)


def keep_freed_memory() -> bool:
    """Have glibc's malloc serve blocks up to MMAP_THRESHOLD from its arenas and keep freed
    memory up to TRIM_THRESHOLD resident (process-wide); False where the C library is not glibc."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    done = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    if not done:
        log.warning("mallopt refused the thresholds: big request bodies decode in fresh memory")
    return done


class BodyDecoder:
    """Runs functions on one thread, inside a core lent by `lend_core`; the thread first
    makes `reserve_bytes` of its malloc arena resident (see the module docstring)."""

    def __init__(
        self,
        lend_core: Callable[[], AbstractAsyncContextManager[None]] = nullcontext,
        reserve_bytes: int = 0,
    ) -> None:
        self.lend_core = lend_core
        self._thread = ThreadPoolExecutor(1, "kvtier-body")
        self._thread.submit(_touch, reserve_bytes).result()  # now, not during the first big body

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on the decoder's thread."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    def close(self) -> None:
        self._thread.shutdown(wait=False)


def _touch(reserve_bytes: int) -> None:
    """Write `reserve_bytes` of this thread's malloc arena, in blocks under MMAP_THRESHOLD,
    and free them: the pages stay mapped for this thread's next allocations."""
    blocks, left = [], reserve_bytes
    while left > 0:
        size = min(left, MMAP_THRESHOLD // 2)
        blocks.append(bytearray(size))  # zero-filled: every page written
        left -= size
    del blocks
