"""CI smoke mode of the benchmark workloads: each one at its --smoke size on a tiny model.

Checks only that a workload completes and writes a valid result (JSON with the run's
header, a Markdown table, a PNG plot), and that the report assembles those results.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import common, report
from bench.cli import WORKLOADS

SMOKE_WORKLOADS = ("multi-round-qa", "rag", "agent-replay", "throughput", "chunked-prefill")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_model_factory) -> Callable[[str], Path]:
    """run(workload) -> the results directory, running each workload once per module."""
    directory = tmp_path_factory.mktemp("bench-results")
    done: dict[str, int] = {}

    def run(workload: str) -> Path:
        if workload not in done:
            module = importlib.import_module(WORKLOADS[workload][0])
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(common, "RESULTS_DIR", directory)
                # --threads 0: keep torch's thread count, the rest of the test session shares it
                done[workload] = module.main(["--smoke", "--threads", "0", "--model", tiny_model_factory()])
        assert done[workload] == 0
        return directory

    return run


@pytest.mark.parametrize("workload", SMOKE_WORKLOADS)
def test_workload_writes_valid_results(smoke_run, workload: str) -> None:
    directory = smoke_run(workload)
    result = json.loads((directory / f"{workload}.json").read_text())
    assert result["workload"] == workload
    assert result["command"].startswith(f"kvtier bench {workload} --smoke")
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["torch"]
    assert result["model"]["num_hidden_layers"] == 2
    assert result["options"]["smoke"] is True
    assert "|---|" in (directory / f"{workload}.md").read_text()
    assert (directory / f"{workload}.png").read_bytes().startswith(PNG_MAGIC)


def test_report_assembles_every_result(smoke_run, tmp_path: Path) -> None:
    for workload in SMOKE_WORKLOADS:
        directory = smoke_run(workload)
    out, img = tmp_path / "BENCHMARKS.md", tmp_path / "img"
    assert report.main(["--results-dir", str(directory), "--out", str(out), "--img-dir", str(img)]) == 0
    text = out.read_text()
    for workload in SMOKE_WORKLOADS:
        assert f"## {workload}" in text
        assert f"![{workload}](img/{workload}.png)" in text
        assert (img / f"{workload}.png").read_bytes().startswith(PNG_MAGIC)
    assert text.count("**What the numbers mean.**") == len(SMOKE_WORKLOADS)


def test_every_smoke_workload_is_registered() -> None:
    assert set(SMOKE_WORKLOADS) <= set(WORKLOADS)
