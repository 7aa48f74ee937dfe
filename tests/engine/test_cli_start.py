"""What `kvtier` does before it serves (issue 44, item 17): every option is checked, and
a bad one reported in one line, before torch (or transformers) is imported, so the error
comes in a second however loaded the machine. Asserted on what is imported, not on time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "fastapi", "engine.models", "engine.llm_engine")
# Runs `kvtier ARGS`, then reports which heavy modules the process had imported.
PROBE = f"""
import sys
from engine.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print("heavy:", [m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)
sys.exit(status)
"""


def run_kvtier(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize(("argv", "line"), [
    (["serve", "--kv-offload", "tape"], "kvtier serve: error: --kv-offload: unknown tier 'tape'"),
    (["serve", "--max-num-seqs", "100000000000"], "kvtier serve: error: --max-num-seqs: "),
    (["serve", "--model", "/no/such/model"], "kvtier serve: error: --model: /no/such/model: no such local"),
    (["serve", "--kv-offload", "redis"], "kvtier serve: error: --kv-redis-url: the redis tier needs a URL"),
    (["generate", "--prompt", "x", "--kv-offload", "tape"], "kvtier generate: error: --kv-offload: unknown tier"),
])
def test_a_bad_option_is_reported_before_any_heavy_import(argv, line):
    done = run_kvtier(*argv)
    error, heavy = done.stderr.splitlines()
    assert done.returncode == 2 and error.startswith(line), done.stderr
    assert heavy == "heavy: []", done.stderr


def test_a_bad_config_file_is_reported_before_any_heavy_import(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text("kv-offload: tape\n")
    done = run_kvtier("serve", "--config", str(path))
    assert done.returncode == 2 and "(set in" in done.stderr and "heavy: []" in done.stderr, done.stderr


def test_download_model_still_checks_its_name():
    done = run_kvtier("download-model", "nope")
    assert done.returncode == 2 and "invalid choice: 'nope' (choose from 'random', 'smollm2', 'tiny')" in done.stderr
