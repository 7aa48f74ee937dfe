"""Shared fixtures: tiny random Hugging Face checkpoints saved to temp dirs."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """make(architecture="llama", **overrides) -> path of a saved tiny checkpoint.

    Checkpoints are built with transformers + save_pretrained and loaded by the engine
    through its real loading code; each distinct set of arguments is built once."""
    from engine.builtin_model import make_model

    built: dict[tuple[str, str], str] = {}

    def make(architecture: str = "llama", **overrides) -> str:
        key = (architecture, json.dumps(overrides, sort_keys=True))
        if key not in built:
            path = tmp_path_factory.mktemp(f"ckpt-{architecture}")
            built[key] = make_model(str(path), architecture=architecture, preset="tiny", **overrides)
        return built[key]

    return make
