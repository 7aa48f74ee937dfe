"""`kvtier bench WORKLOAD` (also `kvtier-bench` and `python -m bench`): run one workload.

The benchmarks are their own distribution (bench/pyproject.toml), not part of the
engine's: the `kvtier` command finds `bench` through the `kvtier.commands` entry point
that distribution declares (`register`), and nothing under engine/ imports bench.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from bench import common, console

WORKLOADS = {
    "engine": ("bench.engine_throughput", "engine vs transformers: mixed-batch throughput, prefill, decode"),
    "store": ("bench.store", "put/get throughput per tier vs memcpy, raw file I/O and a raw Redis socket"),
    "long-doc-qa": ("bench.long_doc_qa", "long-document QA replay: TTFT per round and store tier"),
    "store-hits": ("bench.store_hits", "store-hit TTFT over device-hit TTFT: replay, new question, 2nd instance"),
    "eviction": ("bench.eviction", "LRU against ARC in the cpu and disk tiers: LRU-thrash replay, hot documents among one-offs"),
    "zero-reuse": ("bench.zero_reuse", "no shared prefixes: what the store costs in output tokens/s"),
    "preemption": ("bench.preemption", "beyond KV capacity: offload vs recompute preemption"),
    "cross-instance": ("bench.cross_instance", "a second engine loads what the first saved to Redis"),
    "multi-round-qa": ("bench.multi_round_qa", "users x rounds of chat over a shared system prompt, at a given QPS"),
    "rag": ("bench.rag", "queries of k documents in varying order: only true prefixes hit; chunk size"),
    "rag-blend": ("bench.rag_blend", "documents in any order, blended: accuracy, KL and TTFT vs full prefill"),
    "agent-replay": ("bench.agent_replay", "agents whose growing contexts leave the device while they pause"),
    "agent-tools": ("bench.agent_tools", "agents in the openai client's tool loop against kvtier serve, cache on/off"),
    "throughput": ("bench.throughput", "real-text prompts without reuse at concurrency 1/8/32/64 vs transformers"),
    "chunked-prefill": ("bench.chunked_prefill", "inter-token latency of a decode while long prompts arrive"),
    "startup": ("bench.startup", "start-up of the built-in model: converted checkpoint vs its GGUF file"),
    "structured-outputs": ("bench.structured_outputs", "JSON schemas and tool calls: validity, and cost vs free text"),
    "vs-vllm": ("bench.vs_vllm", "kvtier against vLLM's CPU build through both servers (given --vllm-venv)"),
    "router-index": ("bench.router_index", "the router's index at fleet scale: event ingestion and scoring a long request"),
    "fleet": ("bench.fleet", "instances behind kvtier router: kv vs round-robin vs session, with and without a shared Redis"),
    "neighbours": ("bench.neighbours", "batch-1 decode and prefix-hit TTFT beside neighbours that take CPU"),
}


def workloads_help() -> str:
    """The workloads, one per line, for --help's epilog."""
    width = max(map(len, WORKLOADS))
    return "workloads (WORKLOAD --help: its options; --smoke: tiny sizes for CI):\n" + "\n".join(
        f"  {name:<{width}}  {what}" for name, (_, what) in WORKLOADS.items())


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter  # the epilog's lines kept
    parser.epilog = workloads_help()
    parser.add_argument("--output-dir", type=Path, default=common.DEFAULT_RESULTS_DIR, metavar="DIR",
                        help="Where the results go: WORKLOAD.json, .md, .png, and WORKLOAD.log with "
                        "everything the run printed besides its progress bar and result "
                        "(default: %(default)s).")
    parser.add_argument("workload", choices=sorted(WORKLOADS), metavar="WORKLOAD", help="One of the workloads below.")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER,
                        help="Options of the workload (see WORKLOAD --help); every one has --smoke.")


def register(commands: argparse._SubParsersAction) -> Callable[[argparse.Namespace], int]:
    """The `kvtier.commands` entry point: add `kvtier bench` and return what runs it."""
    parser = commands.add_parser("bench", help="Run a benchmark workload (see `kvtier bench --help`).")
    add_bench_arguments(parser)
    return run_bench


def run_bench(args: argparse.Namespace) -> int:
    """Run the workload with its results under --output-dir and its console captured
    to WORKLOAD.log there (--help prints as usual)."""
    module = importlib.import_module(WORKLOADS[args.workload][0])
    if any(a in ("-h", "--help") for a in args.bench_args):
        return module.main(args.bench_args)
    common.set_results_dir(args.output_dir)
    log = args.output_dir / f"{args.workload}.log"
    with _sigterm_unwinds(), console.captured(log):
        status = module.main(args.bench_args)
    console.echo(f"results in {args.output_dir}/{args.workload}.{{json,md,png}}; log in {log}")
    return status


def main(argv: list[str] | None = None) -> int:
    """`kvtier-bench` / `python -m bench`."""
    parser = argparse.ArgumentParser(prog="kvtier-bench", description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    return run_bench(parser.parse_args(argv))


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM (`kill`, a job's time limit) ends a run as Ctrl-C does, through every
    `finally`: the servers, neighbour processes and Redis a workload started are stopped
    with it, not left running to skew whatever runs next. Python's default would end the
    process at once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
