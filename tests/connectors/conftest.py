"""Fixtures of the connector tests: a tiny fp32 checkpoint (tests/conftest.py builds it;
the Redis servers come from there too)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> str:
    return tiny_model_factory("llama")
