"""Bounded neighbours: processes that take CPU beside a server under test, started and
stopped by the bench, as other jobs share a host's cores.

- busy: one Python busy loop (a single-threaded job that never sleeps);
- torch: another torch process with two OpenMP threads running small bf16 matmuls with
  short pauses (another inference server or a training job's data workers: bursts whose
  threads spin and sleep);
- crowd: two such torch processes and a busy loop.

Each runs in a session of its own, as other jobs on a host do, and so do the servers
under test (bench/served_engines.py): where the kernel schedules by autogroup, CPU is
shared between sessions first, and neighbours in the bench's own session would compete
only with a server that shares it.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

_BUSY = "while True:\n    pass\n"
_TORCH = """
import time, torch
torch.set_num_threads(2)
a, b = torch.randn(256, 256, dtype=torch.bfloat16), torch.randn(256, 256, dtype=torch.bfloat16)
while True:
    for _ in range(20):
        a @ b
    time.sleep(0.002)
"""
NEIGHBOURS: dict[str, tuple[str, ...]] = {
    "quiet": (),
    "busy loop": (_BUSY,),
    "torch process": (_TORCH,),
    "crowd": (_TORCH, _TORCH, _BUSY),
}
# a torch neighbour spends its first seconds importing, not multiplying
SETTLE_S = 3.0


@contextlib.contextmanager
def neighbours(name: str) -> Iterator[list[int]]:
    """Run the neighbours `name` names (a key of NEIGHBOURS) for the block; yields their
    pids. They are killed when the block ends, however it ends."""
    processes = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, start_new_session=True) for code in NEIGHBOURS[name]]
    try:
        if processes:
            time.sleep(SETTLE_S)
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"neighbour {name!r} exited with {process.returncode} before the measurement")
        yield [p.pid for p in processes]
    finally:
        for process in processes:
            process.send_signal(signal.SIGKILL)
            process.wait()
