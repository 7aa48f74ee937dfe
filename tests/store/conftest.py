"""Fixtures of the store tests: a tiny ChunkSpec, block hashes, a hook on the opening of
a file (Redis servers and the Redis Cluster come from tests/conftest.py)."""

from __future__ import annotations

import builtins
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstore import ChunkSpec
from tests.store.store_helpers import make_spec


@pytest.fixture
def spec() -> ChunkSpec:
    return make_spec()


@pytest.fixture
def block_hash() -> Callable[[object], bytes]:
    return lambda label: hashlib.sha256(f"block-{label}".encode()).digest()


@pytest.fixture
def before_open(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path, Callable[[], object]], None]:
    """before_open(path, action): run `action` just before this process next opens `path`
    (with open or os.open). It stands for another process that evicts or replaces a
    record file after this one listed its directory and before it reads the file: that
    exact step of the race, with no timing involved."""
    actions: dict[Path, Callable[[], object]] = {}
    real_open, real_os_open = builtins.open, os.open

    def run_action(file: object) -> None:
        if isinstance(file, str | os.PathLike) and actions:
            action = actions.pop(Path(file), None)
            if action is not None:
                action()

    def hooked_open(file, *args, **kwargs):
        run_action(file)
        return real_open(file, *args, **kwargs)

    def hooked_os_open(path, *args, **kwargs):
        run_action(path)
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", hooked_open)
    monkeypatch.setattr(os, "open", hooked_os_open)
    return actions.__setitem__
