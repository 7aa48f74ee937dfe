"""The read threads (tiers/read_threads.py)."""

from __future__ import annotations

import asyncio
import os

import pytest

from tiers.read_threads import in_read_thread


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_reads_on_threads_of_its_own():
    """The parent's read threads do not exist in a child it forks: a read there must
    not wait for them forever."""
    assert asyncio.run(in_read_thread(int, "1")) == 1  # the parent's pool is running
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its read completed
        try:
            ok = asyncio.run(asyncio.wait_for(in_read_thread(int, "7"), 5)) == 7
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
