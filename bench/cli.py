"""`kvtier bench WORKLOAD`: dispatch to the benchmark modules under bench/."""

from __future__ import annotations

import argparse
import importlib

WORKLOADS = {
    "engine": ("bench.engine_throughput", "engine vs transformers: mixed-batch throughput, prefill, decode"),
    "store": ("bench.store", "put/get throughput per tier vs memcpy, raw file I/O and a raw Redis socket"),
    "long-doc-qa": ("bench.long_doc_qa", "long-document QA replay: TTFT per round and store tier"),
    "store-hits": ("bench.store_hits", "store-hit TTFT over device-hit TTFT: replay, new question, 2nd instance"),
    "zero-reuse": ("bench.zero_reuse", "no shared prefixes: what the store costs in output tokens/s"),
    "preemption": ("bench.preemption", "beyond KV capacity: offload vs recompute preemption"),
    "cross-instance": ("bench.cross_instance", "a second engine loads what the first saved to Redis"),
    "multi-round-qa": ("bench.multi_round_qa", "users x rounds of chat over a shared system prompt, at a given QPS"),
    "rag": ("bench.rag", "queries of k documents in varying order: only true prefixes hit; chunk size"),
    "rag-blend": ("bench.rag_blend", "documents in any order, blended: accuracy, KL and TTFT vs full prefill"),
    "agent-replay": ("bench.agent_replay", "agents whose growing contexts leave the device while they pause"),
    "throughput": ("bench.throughput", "real-text prompts without reuse at concurrency 1/8/32/64 vs transformers"),
    "chunked-prefill": ("bench.chunked_prefill", "inter-token latency of a decode while long prompts arrive"),
    "startup": ("bench.startup", "start-up of the built-in model: converted checkpoint vs its GGUF file"),
}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    help_lines = "; ".join(f"{name}: {what}" for name, (_, what) in WORKLOADS.items())
    parser.add_argument("workload", choices=sorted(WORKLOADS), help=help_lines)
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="Options of the workload (see WORKLOAD --help).")


def run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(WORKLOADS[args.workload][0])
    return module.main(args.bench_args)
