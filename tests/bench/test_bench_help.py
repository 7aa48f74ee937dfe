"""What `kvtier bench` shows (issue 44, item 16): --help lists the workloads one per line,
and result tables write numbers (milliseconds) without exponents."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cli import WORKLOADS
from bench.common import COSTS, markdown_table

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_bench_help_lists_each_workload_on_a_line_of_its_own():
    done = subprocess.run([sys.executable, "-m", "engine.cli", "bench", "--help"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    starts = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ") and line.split()}
    for name, (_, what) in WORKLOADS.items():
        assert name in starts, name
        assert any(line.split()[:1] == [name] and line.endswith(what) for line in done.stdout.splitlines()), name


@pytest.mark.parametrize(("value", "text"), [
    (12345.6, "12346"), (1234.5, "1234"), (123.45, "123"), (12.345, "12.3"), (1.2345, "1.23"),
    (0.012345, "0.0123"), (0.0000123, "0.0000123"), (0.0, "0"),
])
def test_tables_write_numbers_without_exponents(value, text):
    table = markdown_table(["ms"], [[value]])
    assert table.splitlines()[-1] == f"| {text} |"
    assert "e+" not in table and "e-" not in table


@pytest.mark.parametrize("workload", WORKLOADS)
def test_each_workload_help_says_what_its_smoke_and_full_size_cost(workload, capsys):
    """Item 16: a workload's --help says the time and memory of its --smoke and full sizes."""
    module = importlib.import_module(WORKLOADS[workload][0])
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    cost = COSTS[workload]
    assert cost.startswith("--smoke: ") and " GiB " in cost and "full size: " in cost
    assert " ".join(cost.split()) in shown
