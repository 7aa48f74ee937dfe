"""Memory and disk budgets checked at start (issue 44, item 14): a cpu tier larger than
the host's available memory, or a disk budget larger than the disk's room, is a one-line
error before anything is allocated (or torch imported); the start-up summary says how
much memory the server holds."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from engine.config import ConfigError, EngineConfig, check_host_budgets
from tests.server.server_helpers import REPO_ROOT

GiB = 1024**3


def mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def kvtier_serve(*flags: str) -> subprocess.CompletedProcess:
    probe = ("import sys\nfrom engine.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
             "except SystemExit as exc:\n    code = exc.code\nprint('torch' in sys.modules, file=sys.stderr)\n"
             "sys.exit(code)")
    return subprocess.run([sys.executable, "-c", probe, "serve", "--model", "builtin:tiny", *flags],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)


def test_a_cpu_tier_beyond_available_memory_is_refused():
    too_big = f"{mem_available() // GiB + 64}GiB"  # far past any load change meanwhile
    config = EngineConfig(kv_offload="cpu", kv_offload_cpu_size=too_big)
    with pytest.raises(ConfigError, match=r"^--kv-offload-cpu-size: \d+GiB is more than this host's available memory"):
        check_host_budgets(config)
    check_host_budgets(EngineConfig(kv_offload="cpu", kv_offload_cpu_size="64MiB"))


def test_a_disk_budget_beyond_the_free_space_is_refused(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    too_big = f"{free // GiB + 64}GiB"
    config = EngineConfig(kv_offload="disk", kv_offload_disk_path=str(tmp_path / "kv"), kv_offload_disk_size=too_big)
    with pytest.raises(ConfigError, match=r"^--kv-offload-disk-size: \d+GiB is more than the room at .*/kv"):
        check_host_budgets(config)
    check_host_budgets(EngineConfig(kv_offload="disk", kv_offload_disk_path=str(tmp_path / "kv"),
                                    kv_offload_disk_size="1GiB"))


def test_kvtier_serve_says_so_in_one_line_before_importing_torch(tmp_path):
    done = kvtier_serve("--kv-offload", "cpu", "--kv-offload-cpu-size", f"{mem_available() // GiB + 64}GiB")
    assert done.returncode == 2 and done.stderr.splitlines()[1:] == ["False"], done.stderr
    assert done.stderr.startswith("kvtier serve: error: --kv-offload-cpu-size: "), done.stderr
    free = shutil.disk_usage(tmp_path).free
    done = kvtier_serve("--kv-offload", "disk", "--kv-offload-disk-path", str(tmp_path),
                        "--kv-offload-disk-size", f"{free // GiB + 64}GiB")
    assert done.returncode == 2 and done.stderr.startswith("kvtier serve: error: --kv-offload-disk-size: ")


def test_the_start_up_summary_says_what_the_server_holds(server):
    """The shared server (tests/server/conftest.py) has a 64 MiB cpu tier."""
    line = re.search(r"memory +(\d+\.\d) (MiB|GiB) resident, held while it serves: weights, "
                     r"KV pool [\d.]+ [KMG]iB, cpu tier 64\.0 MiB", server.output)
    assert line, server.output
    resident = float(line.group(1)) * (1024 if line.group(2) == "GiB" else 1)
    assert resident > 64  # the cpu tier is faulted in by the time the summary prints
