"""Runs the Triton kernel tests under TRITON_INTERPRET=1, one subprocess per module.

The interpreter is chosen when Triton decorates a kernel, so it must be set before the
first import of triton; a separate process keeps that from leaking into other tests
(on a CUDA machine the engine tests must get the compiled kernels)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["interp_attention.py", "interp_kv_ops.py"])
def test_triton_kernels_under_interpreter(module):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, str(Path(__file__).parent / module)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
