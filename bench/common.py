"""Helpers shared by benchmark workloads: machine facts, timing, result files."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.console import plain_number

DEFAULT_RESULTS_DIR = Path("bench/results")
_results_dir = DEFAULT_RESULTS_DIR


def set_results_dir(path: Path) -> None:
    """Where write_result puts the files (`kvtier bench --output-dir`)."""
    global _results_dir
    _results_dir = Path(path)


def results_dir() -> Path:
    return _results_dir


def machine_info() -> dict:
    import torch
    import transformers

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def add_dtype_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--dtype of a workload's engines; `auto` is bfloat16 where this CPU multiplies it
    natively and float32 where oneDNN would emulate it (about 10x slower), as the engine's
    own auto picks for the built-in model. Results record the dtype the run used."""
    parser.add_argument("--dtype", default="auto", type=_bench_dtype,
                        help="auto (default: bfloat16 with native bf16 matmuls, else float32), "
                             "float32, bfloat16 or float16.")


def _bench_dtype(name: str) -> str:
    if name != "auto":
        return name
    # imported here: engine.models imports torch, which `kvtier` must not need to check its flags
    from engine.models import resolve_dtype

    return str(resolve_dtype("auto", {"torch_dtype": "bfloat16"}, "cpu")).removeprefix("torch.")


def parse_with_smoke(parser: argparse.ArgumentParser, argv: Sequence[str] | None,
                     smoke_sizes: dict[str, object]) -> argparse.Namespace:
    """Parse a workload's options, with `--smoke`: the sizes in `smoke_sizes` replace the
    workload's (CI runs seconds, not minutes, and still goes through the store)."""
    parser.add_argument("--smoke", action="store_true",
                        help="Tiny sizes for CI: checks that it runs and reaches the store, nothing more.")
    add_cost_epilog(parser)
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in smoke_sizes.items():
            setattr(args, name, value)
    return args


# What a run costs, for each workload's --help (issue 44, item 16): `kvtier bench WORKLOAD
# --smoke` as tests/bench/test_smoke.py runs it, on the tiny checkpoint, timed with
# /usr/bin/time -v (wall, max RSS) on the 2-core VM the benchmarks run on, shared with other
# jobs and 1-2 other smoke runs (load average 6-8: times inflated, agent-replay took 40 s to
# 2.4 min as the load varied; the imports alone took ~30 s). Full sizes: not timed here;
# where docs/BENCHMARKS.md gives the timed part of the last full run, it is said.
COSTS: dict[str, str] = {
    "agent-replay": "--smoke: ~40 s to 2.4 min, 1.3 GiB max RSS (2-core VM, load average ~8); full size: not measured here; its 4 timed variants alone took ~1.7 min on a quiet 2-core VM (docs/BENCHMARKS.md)",
    "agent-tools": "--smoke: ~3.2 min, 2.4 GiB max RSS (2-core VM, load average ~7); full size: not measured here",
    "chunked-prefill": "--smoke: ~82 s, 0.8 GiB max RSS (2-core VM, load average ~6); full size: not measured here",
    "cross-instance": "--smoke: ~79 s, 2.9 GiB max RSS (2-core VM, load average ~6); full size: not measured here",
    "engine": "--smoke: ~2.6 min, 2.4 GiB max RSS (2-core VM, load average ~7); full size: not measured here",
    "long-doc-qa": "--smoke: under ~1.7 min (measured before its sizes shrank), 1.3 GiB max RSS (2-core VM, load average ~6); full size: not measured here",
    "eviction": "--smoke: ~2.5 min, 0.8 GiB max RSS (2-core VM, load average ~15); full size: ~27 min, about 5 GiB RSS with its 4 engines (load average ~14)",
    "multi-round-qa": "--smoke: ~2.4 min, 1.3 GiB max RSS (2-core VM, load average ~8); full size: not measured here; its 3 timed variants alone took ~2.5 min on a quiet 2-core VM (docs/BENCHMARKS.md)",
    "preemption": "--smoke: ~86 s, 1.1 GiB max RSS (2-core VM, load average ~6); full size: not measured here",
    "rag": "--smoke: ~94 s, 1.5 GiB max RSS (2-core VM, load average ~7); full size: not measured here; its 3 timed variants alone took ~2.4 min on a quiet 2-core VM (docs/BENCHMARKS.md)",
    "rag-blend": "--smoke: ~1.7 min, 1.0 GiB max RSS (2-core VM, load average ~7); full size: not measured here",
    "startup": "--smoke: ~3.0 min, 1.3 GiB max RSS (2-core VM, load average ~7); full size: not measured here",
    "store": "--smoke: ~31 s, 0.3 GiB max RSS (2-core VM, load average ~6); full size: not measured here",
    "router-index": "--smoke: ~39 s, 0.3 GiB max RSS (2-core VM, load average ~15); full size: ~51 s (64 instances, 1M blocks), 0.5 GiB max RSS (load average ~15)",
    "store-hits": "--smoke: ~84 s, 0.9 GiB max RSS (2-core VM, load average ~7); full size: not measured here",
    "structured-outputs": "--smoke: ~3.0 min, 1.6 GiB max RSS (2-core VM, load average ~8); full size: not measured here",
    "throughput": "--smoke: ~1.9 min, 1.4 GiB max RSS (2-core VM, load average ~7); full size: not measured here",
    "fleet": "--smoke: ~4.3 min, 2.2 GiB RSS over its processes (2 instances, a router, Redis; 2-core VM, load average ~5-9); full size: not measured here (2 fleets of 2 SmolLM2 instances, one thread each: expect well over 30 min on 2 cores)",
    "neighbours": "--smoke: ~4 min, 1.5 GiB RSS over its processes (2-core VM, load average ~16); full size: not measured here; with --vllm-venv add vLLM's start (minutes) and ~3.3 GB",
    "vs-vllm": "--smoke: ~3 min, 1.0 GiB RSS over its processes (2-core VM, load average ~16); full size: not measured here; with --vllm-venv add vLLM's start (minutes) and ~3.3 GB",
    "zero-reuse": "--smoke: ~75 s, 1.9 GiB max RSS (2-core VM, load average ~6); full size: not measured here; its 5 passes of 2 runs of ~23 s took ~4 min on a quiet 2-core VM (docs/BENCHMARKS.md)",
}


def add_cost_epilog(parser: argparse.ArgumentParser) -> None:
    """Add the workload's line of COSTS (its name is the prog's last word) to its --help."""
    cost = COSTS.get(parser.prog.split()[-1])
    if cost:
        parser.epilog = f"{parser.epilog}\n\n{cost}" if parser.epilog else cost


def smoke_engine_options(args: argparse.Namespace) -> dict[str, object]:
    """Engine options of a --smoke run: eager ops (no torch.compile of the fused elementwise
    chains, which costs about 30 s per process on the loaded 2-core VM, most of a smoke run
    on the tiny model; the fused path has its own tests under tests/)."""
    return {"fuse_elementwise": False} if getattr(args, "smoke", False) else {}


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def write_result(name: str, result: dict, markdown: str) -> Path:
    directory = results_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    (directory / f"{name}.md").write_text(markdown)
    return path


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(value: object) -> str:
        return plain_number(value) if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
