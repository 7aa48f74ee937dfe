"""Where a server's time goes beside neighbours: the scheduler's own account of its threads.

/proc/PID/task/TID/schedstat holds, per thread, the nanoseconds it ran on a CPU and the
nanoseconds it waited runnable on a run queue (Linux with schedstats, as every
distribution kernel is built). Summed over every thread of a server and its child
processes, the wait is the time neighbours took from it: a request slower beside a
neighbour by about its waited time lost CPU, one slower by more lost it at barriers
(threads spinning or sleeping for a team mate that was waiting).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import psutil


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """(seconds run on a CPU, seconds waited runnable) of every thread of `pid` and its
    descendants so far; threads that ended meanwhile are not counted."""
    ran = waited = 0
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        tasks = Path(f"/proc/{process.pid}/task")
        try:
            tids = [entry.name for entry in tasks.iterdir()]
        except OSError:
            continue
        for tid in tids:
            try:
                fields = (tasks / tid / "schedstat").read_text().split()
            except OSError:
                continue
            ran += int(fields[0])
            waited += int(fields[1])
    return ran / 1e9, waited / 1e9


def wait_until_idle(pids: Sequence[int], busy_share: float = 0.05, window_s: float = 0.25,
                    limit_s: float = 15.0) -> float:
    """Wait until the servers `pids` (with their descendants) together use less than
    `busy_share` of one CPU over `window_s`, at most `limit_s`; the seconds waited. A
    server still polling after its request (vLLM's engine does for a while) is a
    neighbour of the server measured next: without this, whichever follows it is slower."""
    start = time.perf_counter()
    before = sum(tree_cpu_seconds(pid)[0] for pid in pids)
    while time.perf_counter() - start < limit_s:
        time.sleep(window_s)
        now = sum(tree_cpu_seconds(pid)[0] for pid in pids)
        if now - before < busy_share * window_s:
            break
        before = now
    return time.perf_counter() - start
