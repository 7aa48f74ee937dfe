"""Fixtures of the store tests: a tiny ChunkSpec, block hashes (Redis servers and the
Redis Cluster come from tests/conftest.py)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest

from kvstore import ChunkSpec
from tests.store.store_helpers import make_spec


@pytest.fixture
def spec() -> ChunkSpec:
    return make_spec()


@pytest.fixture
def block_hash() -> Callable[[object], bytes]:
    return lambda label: hashlib.sha256(f"block-{label}".encode()).digest()

