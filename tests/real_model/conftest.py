"""The real model, SmolLM2-135M-Instruct (`builtin:smollm2`), and its oracle.

`make test` installs it first (`kvtier download-model`), so a missing model fails these
tests with the command that fixes it rather than skipping them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.builtin_models import BuiltinModelError, builtin_path, smollm2_gguf_path
from tests.server.server_helpers import ServerProcess


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    try:
        return builtin_path("smollm2")
    except BuiltinModelError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir) -> str:
    return smollm2_gguf_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_dir):
    """transformers' own model on the converted checkpoint (the GGUF's fp32 weights)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def server(smollm2_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    """The README's `kvtier serve --kv-offload cpu,disk` (no --model: SmolLM2), one process
    for every real-model server test, with tiers small enough for a test machine (their
    sizes change no output; the 4 GiB default cpu tier would be faulted in at start)."""
    process = ServerProcess("--kv-offload", "cpu,disk", "--kv-offload-cpu-size", "256MiB",
                            "--kv-offload-disk-path", str(tmp_path_factory.mktemp("kv")),
                            "--kv-offload-disk-size", "1GiB", "--log-level", "warning")
    yield process
    process.stop()
