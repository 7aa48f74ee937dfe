"""Fixtures: the shared server process, an HTTP client for it, and the offline reference."""

from __future__ import annotations

import os

import httpx
import pytest

from tests.server.server_helpers import (
    ADMIN_TOKEN,
    MAX_MODEL_LEN,
    STORELESS_KEY,
    ServerProcess,
    server_flags,
)


@pytest.fixture(scope="session")
def model_path(tiny_model_factory) -> str:
    return tiny_model_factory()


@pytest.fixture(scope="session")
def server(model_path):
    """The shared server: KV admin on, a cpu offload tier configured, 64 KiB body limit."""
    process = ServerProcess(*server_flags(
        model_path, "--enable-kv-admin", "--admin-token", ADMIN_TOKEN,
        "--kv-offload", "cpu", "--kv-offload-cpu-size", "64MiB", "--kv-chunk-tokens", "32",
        "--max-request-bytes", "64KiB",
    ))
    yield process
    process.stop()


@pytest.fixture(scope="session")
def storeless_server(model_path):
    """A server with no KV store and the admin API on (its store operations answer 501),
    whose API key comes from KVTIER_API_KEY alone (no flag, no VLLM_API_KEY): one process
    for the tests of both."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "KVTIER_API_KEY": STORELESS_KEY}
    env.pop("VLLM_API_KEY", None)
    process = ServerProcess(*server_flags(model_path, "--enable-kv-admin", "--admin-token", ADMIN_TOKEN), env=env)
    yield process
    process.stop()


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


@pytest.fixture(scope="session")
def offline_llm(model_path):
    """The offline API on the same checkpoint and options: the reference outputs."""
    from engine import LLM

    return LLM(model=model_path, dtype="float32", num_kv_blocks=256, max_model_len=MAX_MODEL_LEN)
