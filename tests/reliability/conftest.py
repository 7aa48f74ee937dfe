"""Fixtures of the reliability tests: tiny fp32 checkpoints and real redis-server
processes (both from tests/conftest.py), the cold-run oracle, the poisoned
server shared by the HTTP scenarios, and the scorecard written at the end of the session.

Sizes are CI-sized by default; KVTIER_SOAK_SECONDS and KVTIER_SOAK_CLIENTS make the soak
longer or wider, KVTIER_RELIABILITY_JSON says where the scorecard JSON goes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from reliability_support import (
    ADMIN_TOKEN,
    BODY_READ_TIMEOUT_S,
    BODY_READS_PER_CLIENT,
    CHUNK,
    ColdOracle,
    FaultServer,
)
from scorecard import Scorecard

from tests.server.server_helpers import EAGER_OPS


@pytest.fixture(scope="session")
def model_path(tiny_model_factory: Callable[..., str]) -> str:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def other_model_path(tiny_model_factory: Callable[..., str]) -> str:
    """Same architecture and shapes, other weights: another fingerprint."""
    return tiny_model_factory("llama", seed=1)


@pytest.fixture(scope="session")
def cold() -> ColdOracle:
    return ColdOracle()


@pytest.fixture(scope="session")
def scorecard(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[Scorecard]:
    """Collects one entry per scenario; written as JSON when the session ends."""
    card = Scorecard()
    yield card
    default = tmp_path_factory.getbasetemp() / "reliability.json"
    path = Path(os.environ.get("KVTIER_RELIABILITY_JSON") or default)
    card.write(path)
    reporter = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"reliability scorecard: {path}")


@pytest.fixture(scope="session")
def fault_server(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultServer]:
    """The poisoned model behind the real server: cpu and disk tiers with small budgets,
    a device pool of 96 blocks (1536 tokens), 16 running requests at most, and short
    limits on slow request bodies."""
    disk = tmp_path_factory.mktemp("server-kv")
    server = FaultServer(
        "--model", model_path, "--dtype", "float32", "--served-model-name", "tiny", EAGER_OPS,
        "--num-kv-blocks", "96", "--max-num-seqs", "16", "--kv-chunk-tokens", str(CHUNK),
        "--kv-offload", "cpu,disk", "--kv-offload-cpu-size", "1MiB",
        "--kv-offload-disk-path", str(disk), "--kv-offload-disk-size", "4MiB",
        "--enable-kv-admin", "--admin-token", ADMIN_TOKEN, "--max-request-bytes", "256KiB",
        "--max-waiting-requests", "512", "--body-read-timeout", str(BODY_READ_TIMEOUT_S),
        "--max-body-reads-per-client", str(BODY_READS_PER_CLIENT), "--log-level", "warning",
    )
    yield server
    server.stop()
