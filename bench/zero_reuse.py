"""Zero reuse: random prompts with no shared prefix at high concurrency, so the store
never serves anything and only costs (lookups, copying chunks out, background writes).
Output tokens/s with offload against the same engine without it (target: >= 97%).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench import plots
from bench.common import markdown_table
from bench.driver import random_tokens
from bench.kv_common import STORE_CONFIGS, local_redis, numeric_stats, serve, store_options
from bench.profiling import profile_note, profile_requests, profile_tables
from bench.summary import checkpoint, publish, run_stamp, workload_parser
from engine import LLM, SamplingParams

NAME = "zero-reuse"
TARGET = 0.97  # offload output tok/s / no-offload output tok/s


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "one wave of prompts on the last offload configuration")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--configs", nargs="+", default=("none", "cpu+disk"), choices=sorted(STORE_CONFIGS))
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--redis-url", default=None)
    return p.parse_args(argv)


@contextmanager
def store_engine(args: argparse.Namespace, model: str, config: str, prompts: list[list[int]],
                 redis_url: str | None) -> Iterator[LLM]:
    """An engine with the store configuration `config` (disk records in a fresh temp
    directory), warmed up on the first `concurrency` prompts."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as workdir, LLM(
            model=model, dtype=args.dtype, max_num_seqs=args.concurrency, kv_chunk_tokens=args.chunk_tokens,
            **store_options(config, Path(workdir), redis_url)) as llm:
        serve(llm.engine, prompts[: args.concurrency], SamplingParams(max_tokens=2), args.concurrency, "warm")
        yield llm


def run(args: argparse.Namespace, model: str, config: str, prompts: list[list[int]], redis_url: str | None) -> dict:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with store_engine(args, model, config, prompts, redis_url) as llm:
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = serve(llm.engine, prompts[args.concurrency :], params, args.concurrency)
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        stats = numeric_stats(llm.engine)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "cpu_s": cpu_s, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "saved_chunks": stats.get("kv_saved_chunks", 0), "save_copy_s": stats.get("kv_save_copy_seconds", 0.0)}


def profile(args: argparse.Namespace, model: str, prompts: list[list[int]], redis_url: str | None) -> dict:
    """Where the store costs most: one wave of `concurrency` new prompts on the last
    offload configuration, every full chunk copied out and saved."""
    config = [c for c in args.configs if c != "none"][-1:] or ["none"]
    with store_engine(args, model, config[0], prompts, redis_url) as llm:
        return profile_requests(llm, prompts[: args.concurrency], args.output_len,
                                f"{args.concurrency} new prompts at once with the {config[0]} store")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    total = args.num_prompts + args.concurrency  # the first `concurrency` warm the engine up
    model, vocab = checkpoint(args)
    rng = random.Random(args.seed)
    prompts = [random_tokens(rng, args.prompt_len, vocab) for _ in range(total)]
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": model, "runs": {}}
    needs_redis = any("redis" in STORE_CONFIGS[c] for c in args.configs)
    with local_redis(args.redis_url if needs_redis else "unused") as redis_url:
        for config in args.configs:
            result["runs"][config] = run(args, model, config, prompts, redis_url)
            print(config, result["runs"][config], flush=True)
        if args.profile:
            result["profile"] = profile(args, model, prompts, redis_url)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def ratio(result: dict, name: str) -> float:
    """Output tok/s of a configuration over no offload's (nan without a `none` run)."""
    base = result["runs"].get("none", {}).get("output_tok_s")
    return result["runs"][name]["output_tok_s"] / base if base else float("nan")


def render(result: dict) -> str:
    runs = result["runs"]
    rows = [[name, r["seconds"], r.get("cpu_s", "n/a"), r["output_tok_s"], ratio(result, name), r["saved_chunks"],
             r["save_copy_s"]] for name, r in runs.items()]
    args = result["args"]
    text = (f"Zero reuse: {args['num_prompts']} prompts x {args['prompt_len']} tokens, "
            f"{args['output_len']} output tokens, {args['concurrency']} in flight, {args['dtype']}\n\n"
            + markdown_table(["store", "seconds", "CPU s", "output tok/s", f"vs none (target >= {TARGET})",
                              "chunks saved", "save copy s"], rows))
    return text + profile_tables(result)


def plot(result: dict) -> None:
    runs = result["runs"]
    base = runs.get("none", {}).get("output_tok_s")
    target = {f"{TARGET:.0%} of none": TARGET * base} if base else {}
    panels = [plots.Panel("Output throughput (wall clock)", "store", "output tokens/s", list(runs),
                          plots.columns(runs, {"output tok/s": "output_tok_s"}), kind="bar", hlines=target)]
    if all("cpu_s" in r for r in runs.values()):
        per_cpu = {"per CPU-second": [r["output_tokens"] / r["cpu_s"] for r in runs.values()]}
        panels.append(plots.Panel("Output tokens per CPU-second", "store", "tokens / CPU-s", list(runs), per_cpu,
                                  kind="bar"))
    plots.save_figure(plots.png_path(NAME), panels, "Zero reuse: what the store costs when nothing is reused")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    runs, args = result["runs"], result["args"]
    stores = [name for name in runs if name != "none"]
    text = (f"No two of the {args['num_prompts']} prompts share a prefix, so the store never serves a token and "
            "only costs: a lookup per admitted request, copying every full chunk out of the device cache after "
            "the forward that completes it (in the step), and writing it to the tiers (write-behind threads). ")
    if "none" in runs:
        shares = [f"{name} {runs[name]['output_tok_s']:.0f} ({100 * ratio(result, name):.0f}% of none, "
                  f"{'meets' if ratio(result, name) >= TARGET else 'misses'} the {TARGET:.0%} target)"
                  for name in stores]
        text += f"Output tokens/s: none {runs['none']['output_tok_s']:.0f}; " + "; ".join(shares) + ". "
        if any(ratio(result, name) > 1 for name in stores):
            text += ("A ratio above 100% is the shared machine drifting between runs made one after the other: "
                     "the store adds work, it cannot remove any. ")
        if all("cpu_s" in r for r in runs.values()):
            cpu = [f"{name} {runs[name]['cpu_s']:.0f} s ({100 * (runs[name]['cpu_s'] / runs['none']['cpu_s'] - 1):+.0f}%)"
                   for name in stores]
            text += (f"CPU time, which counts the work whatever else runs: none {runs['none']['cpu_s']:.0f} s, "
                     + ", ".join(cpu) + ". ")
    copies = [f"{name} saved {runs[name]['saved_chunks']} chunks of {args['chunk_tokens']} tokens and copying them "
              f"out took {runs[name]['save_copy_s']:.2f} s, {100 * runs[name]['save_copy_s'] / runs[name]['seconds']:.1f}% "
              f"of its {runs[name]['seconds']:.0f} s run" for name in stores]
    if copies:
        text += "Where the store's time goes: " + "; ".join(copies) + " (the only part a step waits for). "
    return (text + profile_note(result)).strip()
