"""A real `kvtier serve` process on a free loopback port, started and stopped from Python."""

from __future__ import annotations

import http.client
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlparse

# A server that loads the real model and compiles its fused ops needs minutes, not seconds,
# on a 2-core machine that other jobs share; a slow start must not fail a run.
STARTUP_TIMEOUT_S = 600


class ServerProcess:
    """`python -m engine.cli serve ...` with --port 0; the URL comes from its startup summary.

    `command` replaces `python -m engine.cli serve` by another entry point taking the same
    flags (the reliability tests' poisoned server), `env` the environment it runs in.
    `new_session`: run it in a session of its own, as a separate service runs. Where the
    kernel schedules by autogroup (`/proc/sys/kernel/sched_autogroup_enabled`), CPU is
    shared between sessions first: a server in its starter's session shares one
    session's share with every other process started there."""

    def __init__(
        self,
        *flags: str,
        command: Sequence[str] = (sys.executable, "-m", "engine.cli", "serve"),
        env: dict[str, str] | None = None,
        new_session: bool = False,
    ) -> None:
        self.flags = flags
        env = env if env is not None else {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [*command, "--port", "0", *flags], env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=new_session,
        )
        self.lines: list[str] = []
        self._url_seen = threading.Event()
        self.url = ""
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        try:
            self._wait_ready()
        except BaseException:  # a test's time limit or Ctrl-C while it starts: leave no server behind
            self.stop(signal.SIGKILL, timeout=10)
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def host_port(self) -> tuple[str, int]:
        parsed = urlparse(self.url)
        return parsed.hostname or "127.0.0.1", parsed.port or 80

    def _read_output(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            match = re.search(r"URL\s+(http://\S+)", line)
            if match:
                self.url = match.group(1)
                self._url_seen.set()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline and self.process.poll() is None:
            if self._url_seen.is_set() and self._healthy():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError("server did not start:\n" + self.output)

    def _healthy(self) -> bool:
        return answers_health(*self.host_port)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            code = self.process.wait()
        self._reader.join(timeout=5)  # its last lines, until the pipe's end
        if not self._reader.is_alive():
            self.process.stdout.close()
        return code


def answers_health(host: str, port: int, timeout: float = 1) -> bool:
    """Whether a server at host:port answers GET /health with 200 (kvtier's and vLLM's)."""
    connection = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()
