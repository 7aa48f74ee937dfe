"""A benchmark run that is stopped leaves nothing behind: SIGTERM unwinds it through its
`finally` blocks (which stop the servers and neighbours it started), and a server whose
start is interrupted is killed, not orphaned."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from bench.server_process import ServerProcess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIGTERMED_RUN = """
import os, signal, time
from bench.cli import _sigterm_unwinds
with _sigterm_unwinds():
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    finally:
        print("cleaned up", flush=True)
"""


def test_sigterm_runs_the_finally_blocks_and_exits_143():
    done = subprocess.run([sys.executable, "-c", SIGTERMED_RUN], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "cleaned up\n", done.stderr
    assert done.returncode == 128 + signal.SIGTERM


class _Interrupted(Exception):
    pass


def test_a_server_start_interrupted_kills_the_server(monkeypatch):
    def interrupt(signum: int, frame: object) -> None:
        raise _Interrupted

    started: list[int] = []
    real_popen = subprocess.Popen

    def recording_popen(*args: object, **kwargs: object) -> subprocess.Popen:
        process = real_popen(*args, **kwargs)
        started.append(process.pid)
        return process

    monkeypatch.setattr(subprocess, "Popen", recording_popen)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(_Interrupted):  # a "server" that never becomes ready
            ServerProcess(command=(sys.executable, "-c", "import time; time.sleep(120)"))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert len(started) == 1
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{started[0]}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{started[0]}")
