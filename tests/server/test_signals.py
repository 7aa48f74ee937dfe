"""SIGINT and SIGTERM (issue 44, item 11). During start-up, at any moment: one line and
status 130 (no KeyboardInterrupt traceback, no `terminate called without an active
exception`). During a stream: SIGINT ends every open stream at once, SIGTERM after
--shutdown-timeout, each with a last chunk `finish_reason: "abort"` and `[DONE]`, and
no traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.server_helpers import REPO_ROOT, ServerProcess, server_flags

pytestmark = pytest.mark.timeout(300)
START_LINE = r"kvtier( serve)?: SIGINT during start-up, stopped"  # " serve" once the flags are parsed


def _loads_torch(pid: int) -> bool:
    """Whether the process has begun to load torch's library (its import is under way)."""
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


@pytest.mark.parametrize("after_s", [0.0, 2.0, 5.0], ids=["importing-torch", "2s-later", "5s-later"])
def test_ctrl_c_at_any_moment_of_start_up_is_one_line_and_130(model_path, after_s):
    """The moments: while torch loads, then seconds later (the model load, the cpu tier's
    fault-in thread, the server's start), whatever the host's load."""
    process = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "serve", *server_flags(model_path, "--kv-offload", "cpu",
                                                                    "--kv-offload-cpu-size", "64MiB"),
         "--port", "0"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not _loads_torch(process.pid):
            assert time.monotonic() < deadline and process.poll() is None, "torch never loaded"
            time.sleep(0.002)
        time.sleep(after_s)
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130, (out, err)
    assert "Traceback" not in err and "terminate called" not in err, err
    if "URL" not in out:  # stopped before it served: the one line is all it says
        assert len(err.splitlines()) == 1 and re.fullmatch(START_LINE, err.strip()), err


def _stream_then_signal(server: ServerProcess, sig: int) -> list[dict]:
    """Start a stream of two choices far longer than the test, signal the server after
    its first chunk, and return every chunk after it until [DONE] (asserted)."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4000, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as stream:
        lines = stream.iter_lines()
        first = next(lines)
        server.process.send_signal(sig)
        events = [first, *(line for line in lines if line)]
    assert events[-1] == "data: [DONE]", events[-3:]
    return [json.loads(event.removeprefix("data: ")) for event in events[:-1]]


def _last_finish(chunks: list[dict]) -> dict[int, str | None]:
    finish = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            finish[choice["index"]] = choice["finish_reason"]
    return finish


def test_sigint_ends_open_streams_at_once_with_abort_and_done(model_path):
    server = ServerProcess(*server_flags(model_path, "--max-model-len", "4096", "--shutdown-timeout", "600"))
    try:
        chunks = _stream_then_signal(server, signal.SIGINT)
        assert _last_finish(chunks) == {0: "abort", 1: "abort"}
        assert server.process.wait(120) == 130
    finally:
        server.stop(signal.SIGKILL)
    assert "Traceback" not in server.output and "CancelledError" not in server.output, server.output


def test_sigterm_drains_then_ends_open_streams_with_abort_and_done(model_path):
    server = ServerProcess(*server_flags(model_path, "--max-model-len", "4096", "--shutdown-timeout", "1"))
    try:
        chunks = _stream_then_signal(server, signal.SIGTERM)
        assert _last_finish(chunks) == {0: "abort", 1: "abort"}
        assert server.process.wait(120) == 0
    finally:
        server.stop(signal.SIGKILL)
    assert "Traceback" not in server.output and "CancelledError" not in server.output, server.output
