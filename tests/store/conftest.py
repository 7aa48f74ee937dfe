"""Fixtures of the store tests: a Redis Cluster of real redis-server processes (single
servers come from tests/conftest.py), a tiny ChunkSpec, block hashes."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import pytest

from bench.redis_server import RedisServer
from kvstore import ChunkSpec
from tests.store.store_helpers import build_cluster, make_spec


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

