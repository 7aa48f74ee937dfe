"""A child process that keeps the server's place on the CPUs while the engine steps.

Where the kernel shares CPU between groups of processes first (autogroup: one group per
session; cgroups), each group gets its share only while it has a thread ready to run.
An unbound OpenMP team waiting passively (engine/cpu_threads.py) sleeps at every
barrier, hundreds of times per decode step. Beside other busy groups, each time the
team's last runnable thread sleeps the server's group leaves the CPU's run queue, and a
thread that wakes must then wait for the other groups' slices: the team gets a fraction
of the share it is entitled to and a decode step stretches several times.

The seat keeper is a child process in the server's session (so in its group) that calls
sched_yield in a loop while the engine has requests to run, so that the group does not
leave the run queue of the keeper's CPU. It blocks on a pipe while the engine is idle.
A yield gives the CPU away only until the keeper is picked again, so the keeper takes
turns with a team thread on its CPU; that is the price of the place it keeps.

It is off unless asked for (`--cpu-seat-keeper`): on a quiet host, or beside a few
busy processes, the keeper takes turns with the team on its CPU and decode slows by about
a tenth; it pays where many busy processes share each core (docs/notes/cpu-seat-keeper.md).
It runs only beside an unbound team of two or more threads, in a process without a CPU
quota: one thread computing alone never sleeps mid-step, a team bound to CPUs of its own
has no one to lose them to, and under a quota (a container's `cpu.max`) every yield
would spend time the team then misses when the quota throttles the group.
"""

from __future__ import annotations

import os
import subprocess
import sys

from engine.cpu_threads import ThreadPlan

# The child: yield while the last byte read from the pipe is b"1", block on the pipe
# while it is b"0", exit at end of file (the engine closed it, or its process died). A
# Ctrl-C reaches the terminal's whole process group: the server handles it, and the
# keeper ends with the server instead of printing a KeyboardInterrupt of its own.
_KEEPER = """
import os, select, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
fd = int(sys.argv[1])
holding = False
while True:
    if holding:
        for _ in range(256):
            os.sched_yield()
        if not select.select([fd], [], [], 0)[0]:
            continue
    data = os.read(fd, 64)
    if not data:
        break
    holding = data.endswith(b"1")
"""


def wants_seat_keeper(enabled: bool, plan: ThreadPlan) -> bool:
    """Whether an engine with this thread plan runs a seat keeper (see the module's why)."""
    return enabled and plan.num_threads >= 2 and plan.cpus is None and plan.cpu_quota is None


class SeatKeeper:
    """The keeper process: `hold(True)` while the engine has requests, `hold(False)`
    when it has none, `close()` at shutdown (the child exits)."""

    def __init__(self) -> None:
        read_end, self._write_end = os.pipe()
        try:
            # -I -S: no site or user paths to import; the child needs only os and select
            self.process = subprocess.Popen([sys.executable, "-I", "-S", "-c", _KEEPER, str(read_end)],
                                            pass_fds=(read_end,), stdin=subprocess.DEVNULL)
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)
        self._holding = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def holding(self) -> bool:
        return self._holding

    def hold(self, holding: bool) -> None:
        if holding != self._holding and self._write_end >= 0:
            os.write(self._write_end, b"1" if holding else b"0")
            self._holding = holding

    def close(self) -> None:
        """End the child: end of file on its pipe, then wait for it (briefly: it blocks on
        the pipe or checks it every few hundred yields)."""
        if self._write_end < 0:
            return
        os.close(self._write_end)
        self._write_end = -1
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
