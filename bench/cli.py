"""`kvtier bench WORKLOAD`: dispatch to the benchmark modules under bench/."""

from __future__ import annotations

import argparse
import importlib

WORKLOADS = {
    "engine": ("bench.engine_throughput", "engine vs transformers: mixed-batch throughput, prefill, decode"),
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    help_lines = "; ".join(f"{name}: {what}" for name, (_, what) in WORKLOADS.items())
    parser.add_argument("workload", choices=sorted(WORKLOADS), help=help_lines)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="Options of the workload (see WORKLOAD --help).")


def run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(WORKLOADS[args.workload][0])
    return module.main(args.bench_args)
