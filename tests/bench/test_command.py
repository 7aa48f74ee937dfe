"""`kvtier bench` is a plugin: bench registers it through the `kvtier.commands` entry point,
engine never imports bench; a run keeps the console to its progress and result and puts
the rest in WORKLOAD.log under --output-dir."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def run(args: list[str], extra_path: Path | None = None, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess:
    path = [str(REPO_ROOT)] + ([str(extra_path)] if extra_path else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def installed_bench(tmp_path: Path) -> Path:
    """A site directory holding kvtier-bench's metadata as `pip install -e bench/` writes it."""
    info = tmp_path / "site" / "kvtier_bench-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtier-bench\nVersion: 0.1.0\n")
    project = tomllib.loads((REPO_ROOT / "bench" / "pyproject.toml").read_text())["project"]
    commands = project["entry-points"]["kvtier.commands"]
    (info / "entry_points.txt").write_text(
        "[kvtier.commands]\n" + "".join(f"{name} = {target}\n" for name, target in commands.items()))
    return tmp_path / "site"


PLUGIN_MODULES = {"bench", "bench.cli", "bench.common", "bench.console"}


def test_engine_never_imports_bench():
    imports = re.compile(r"^\s*(import bench\b|from bench\b)", re.M)
    assert [p for p in (REPO_ROOT / "engine").rglob("*.py") if imports.search(p.read_text())] == []
    done = run(["-c", "import json, sys, engine.cli; engine.cli.build_parser(); "
                      "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'bench')))"])
    # Where kvtier-bench is installed (make install does), its entry point registers the
    # command: its own light modules load, never a workload (nor torch code of bench).
    assert set(json.loads(done.stdout)) <= PLUGIN_MODULES, done.stderr


def test_kvtier_bench_comes_from_the_entry_point(tmp_path):
    site = installed_bench(tmp_path)
    done = run(["-m", "engine.cli", "bench", "--help"], extra_path=site)
    assert done.returncode == 0, done.stderr
    assert "--output-dir DIR" in done.stdout and "long-doc-qa" in done.stdout


# engine.cli's `main` with no kvtier.commands entry point visible, whether or not
# kvtier-bench is installed here.
WITHOUT_PLUGINS = ("import importlib.metadata, sys; importlib.metadata.entry_points = lambda **_: (); "
                   "import engine.cli; sys.exit(engine.cli.main(sys.argv[1:]))")


def test_kvtier_bench_without_the_plugin_says_how_to_get_it(tmp_path):
    done = run(["-c", WITHOUT_PLUGINS, "bench", "store", "--smoke"], cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip() == ("kvtier bench: not installed; the benchmarks: `pip install -e bench/` "
                                   "in a checkout, or `python -m bench`")


def test_a_run_writes_under_output_dir_and_logs_the_rest(tmp_path):
    out = tmp_path / "results"
    site = installed_bench(tmp_path)
    done = run(["-m", "engine.cli", "bench", "--output-dir", str(out), "store", "--smoke",
                "--tiers", "cpu", "disk"], extra_path=site, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert {p.name for p in out.iterdir()} == {"store.json", "store.md", "store.png", "store.log"}
    assert json.loads((out / "store.json").read_text())["workload"] == "store"
    # the console: the result table, then where the files are; nothing else
    assert done.stdout.strip().endswith(f"results in {out}/store.{{json,md,png}}; log in {out}/store.log")
    assert done.stdout.startswith((out / "store.md").read_text().strip().splitlines()[0])
    assert not (tmp_path / "bench").exists()  # nothing under the working directory


def test_python_m_bench_is_the_same_command(tmp_path):
    done = run(["-m", "bench", "--output-dir", str(tmp_path), "startup", "--help"])
    assert done.returncode == 0 and "--smoke" in done.stdout
