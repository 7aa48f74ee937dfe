"""Zero reuse: real-text prompts with no shared prefix at high concurrency, so the store
never serves anything and only costs (lookups, copying chunks out, background writes).
Each offload engine faults in its cpu tier's memory before it is timed, as a server does
at start.
Output tokens/s with offload against the same engine without it (target: >= 97%).

Prompt lengths are uniform in [(1 - spread) L, (1 + spread) L], so most prompts end
inside a chunk and the connector saves their tail record too. The configurations run
interleaved over --repeats passes, every other pass in reverse order (none, cpu+disk,
cpu+disk, none, ...: a steady drift of the machine cancels), each run on a fresh engine
and store; a pass has prompts of its own, shared by its configurations, so
nothing one run saved can serve another. Reported per configuration: the median over
passes, and the median of the per-pass paired ratios (offload / none) in output tokens
per wall-clock second and per CPU-second of the process.
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
from bench.common import markdown_table, median, parse_with_smoke, smoke_engine_options
from bench.kv_common import STORE_CONFIGS, delta, local_redis, numeric_stats, serve, store_options
from bench.profiling import profile_note, profile_requests, profile_tables
from bench.summary import checkpoint, publish, run_stamp, workload_parser
from bench.text_corpus import CorpusTokens
from connectors.planner import ChunkGeometry
from engine import LLM, SamplingParams

NAME = "zero-reuse"
TARGET = 0.97  # offload output tok/s / no-offload output tok/s


SMOKE = {"num_prompts": 3, "prompt_len": 48, "output_len": 4, "concurrency": 2, "chunk_tokens": 32,
         "configs": ["none", "cpu+disk"], "repeats": 2, "kv_offload_cpu_size": "16MiB"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "one wave of prompts on the last offload configuration")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=1024, help="Mean prompt length L.")
    p.add_argument("--len-spread", type=float, default=0.25,
                   help="Prompt lengths are uniform in [(1 - spread) L, (1 + spread) L] (default 0.25).")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--configs", nargs="+", default=["none", "cpu+disk"], choices=sorted(STORE_CONFIGS))
    p.add_argument("--repeats", type=int, default=3,
                   help="Passes over the configurations, interleaved, each with its own prompts (default 3).")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--kv-offload-cpu-size", default=None, help="The cpu tier's size (default: the engine's).")
    p.add_argument("--redis-url", default=None)
    return parse_with_smoke(p, argv, SMOKE)


def length_range(args: argparse.Namespace) -> tuple[int, int]:
    return max(1, round((1 - args.len_spread) * args.prompt_len)), round((1 + args.len_spread) * args.prompt_len)


def make_prompts(args: argparse.Namespace, rng: random.Random, corpus: CorpusTokens) -> list[list[int]]:
    """One pass's prompts of real text: `concurrency` to warm an engine up, then the
    measured ones (each from its own point of the corpus, so no two share a block)."""
    low, high = length_range(args)
    return [corpus.take(rng, rng.randint(low, high)) for _ in range(args.num_prompts + args.concurrency)]


@contextmanager
def store_engine(args: argparse.Namespace, model: str, config: str, prompts: list[list[int]],
                 redis_url: str | None) -> Iterator[tuple[LLM, float]]:
    """An engine with the store configuration `config` (disk records in a fresh temp
    directory), its host memory faulted in as `kvtier serve` does at start, warmed up on
    the first `concurrency` prompts. Yields the engine and the seconds that faulting in took."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as workdir, LLM(
            model=model, dtype=args.dtype, max_num_seqs=args.concurrency, kv_chunk_tokens=args.chunk_tokens,
            **store_options(config, Path(workdir), redis_url), **smoke_engine_options(args),
            **({"kv_offload_cpu_size": args.kv_offload_cpu_size} if args.kv_offload_cpu_size else {})) as llm:
        start = time.perf_counter()
        llm.engine.connector.make_resident()
        resident_s = time.perf_counter() - start
        serve(llm.engine, prompts[: args.concurrency], SamplingParams(max_tokens=2), args.concurrency, "warm")
        yield llm, resident_s


def run(args: argparse.Namespace, model: str, config: str, prompts: list[list[int]], redis_url: str | None) -> dict:
    """One configuration on a fresh engine: the prompts after the first `concurrency`
    (which warm it up), timed; engine counters are those the timed part moved."""
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    measured = prompts[args.concurrency :]
    with store_engine(args, model, config, prompts, redis_url) as (llm, resident_s):
        before = numeric_stats(llm.engine)
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = serve(llm.engine, measured, params, args.concurrency)
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        stats = delta(before, numeric_stats(llm.engine))
        geometry = ChunkGeometry(llm.engine.config.block_size, args.chunk_tokens)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "cpu_s": cpu_s, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "output_tok_per_cpu_s": tokens / cpu_s, "prompt_tokens": sum(map(len, measured)),
            "prompts_with_tail": sum(geometry.tail(len(p) // geometry.block_size) is not None for p in measured),
            "saved_chunks": stats.get("kv_saved_chunks", 0), "save_copy_s": stats.get("kv_save_copy_seconds", 0.0),
            "loaded_tokens": stats.get("kv_loaded_tokens", 0), "resident_s": resident_s}


def profile(args: argparse.Namespace, model: str, prompts: list[list[int]], redis_url: str | None) -> dict:
    """Where the store costs most: one wave of `concurrency` new prompts on the last
    offload configuration, every full chunk copied out and saved."""
    config = [c for c in args.configs if c != "none"][-1:] or ["none"]
    with store_engine(args, model, config[0], prompts, redis_url) as (llm, _):
        return profile_requests(llm, prompts[: args.concurrency], args.output_len,
                                f"{args.concurrency} new prompts at once with the {config[0]} store")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    model, _ = checkpoint(args)
    rng, corpus = random.Random(args.seed), CorpusTokens.for_model(model)
    passes = [make_prompts(args, rng, corpus) for _ in range(args.repeats)]
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": model, "passes": []}
    needs_redis = any("redis" in STORE_CONFIGS[c] for c in args.configs)
    with local_redis(args.redis_url if needs_redis else "unused") as redis_url:
        for number, prompts in enumerate(passes, 1):
            result["passes"].append({})
            order = args.configs if number % 2 else args.configs[::-1]
            for config in order:
                result["passes"][-1][config] = run(args, model, config, prompts, redis_url)
                print(f"pass {number}", config, result["passes"][-1][config], flush=True)
        if args.profile:
            result["profile"] = profile(args, model, passes[0], redis_url)
    result["runs"] = {c: {k: median([p[c][k] for p in result["passes"]]) for k in result["passes"][0][c]}
                      for c in args.configs}
    if "none" in args.configs:
        result["paired"] = {c: paired(result["passes"], c) for c in args.configs if c != "none"}
    plot(result)
    publish(NAME, result, render(result))
    return 0


def paired(passes: list[dict], config: str) -> dict:
    """Per pass, `config` over no offload in output tok/s (wall) and output tokens per
    CPU-second, and the median of each."""
    wall = [p[config]["output_tok_s"] / p["none"]["output_tok_s"] for p in passes]
    cpu = [p[config]["output_tok_per_cpu_s"] / p["none"]["output_tok_per_cpu_s"] for p in passes]
    return {"wall_ratio": median(wall), "cpu_ratio": median(cpu), "wall_ratios": wall, "cpu_ratios": cpu}


# ---- output -------------------------------------------------------------------------------


def ratio(result: dict, name: str, cpu: bool = False) -> float:
    """A configuration over no offload, in output tok/s (`cpu`: output tokens per
    CPU-second): the median of the per-pass paired ratios; for a single-pass result (from
    before --repeats), the ratio of its runs. nan without a `none` run (or CPU times)."""
    if "paired" in result:
        return result["paired"][name]["cpu_ratio" if cpu else "wall_ratio"] if name != "none" else 1.0
    runs = result["runs"]
    if "none" not in runs or (cpu and not all("cpu_s" in r for r in runs.values())):
        return float("nan")
    per = (lambda r: r["output_tokens"] / r["cpu_s"]) if cpu else (lambda r: r["output_tok_s"])
    return per(runs[name]) / per(runs["none"])


def render(result: dict) -> str:
    args, runs = result["args"], result["runs"]
    low, high = length_range(argparse.Namespace(**args))
    text = (f"Zero reuse: {args['num_prompts']} prompts of {low}-{high} tokens (uniform), {args['output_len']} output "
            f"tokens, {args['concurrency']} in flight, {args['dtype']}; {args['repeats']} passes over the "
            "configurations, interleaved, each run on a fresh engine. Medians over the passes; the ratios to none "
            "are medians of the per-pass paired ratios.\n\n")
    rows = [[name, r["output_tok_s"], ratio(result, name), ratio(result, name, cpu=True), r["seconds"], r["cpu_s"],
             r["saved_chunks"], r["save_copy_s"], r["loaded_tokens"]] for name, r in runs.items()]
    text += markdown_table(["store", "output tok/s", f"vs none, wall (target >= {TARGET})", "vs none, per CPU-s",
                            "seconds", "CPU s", "chunks saved", "save copy s", "store hit tokens"], rows)
    rows = []
    for number, runs_of_pass in enumerate(result["passes"], 1):
        for name, r in runs_of_pass.items():
            pair = result.get("paired", {}).get(name)
            rows.append([number, name, r["seconds"], r["cpu_s"], r["output_tok_s"],
                         pair["wall_ratios"][number - 1] if pair else "", pair["cpu_ratios"][number - 1] if pair else "",
                         r["saved_chunks"], r["prompts_with_tail"]])
    text += "\nPer pass:\n\n" + markdown_table(["pass", "store", "seconds", "CPU s", "output tok/s", "vs none, wall",
                                                 "vs none, per CPU-s", "chunks saved", "prompts ending in a tail"],
                                                rows)
    return text + profile_tables(result)


def plot(result: dict) -> None:
    runs = result["runs"]
    base = runs.get("none", {}).get("output_tok_s")
    target = {f"{TARGET:.0%} of none": TARGET * base} if base else {}
    label = "median over passes" if "passes" in result else "one pass"
    panels = [plots.Panel(f"Output throughput ({label})", "store", "output tokens/s", list(runs),
                          plots.columns(runs, {"output tok/s": "output_tok_s"}), kind="bar", hlines=target)]
    if "paired" in result:
        ratios = {}
        for name, pair in result["paired"].items():
            ratios[f"{name}, wall"] = [100 * x for x in pair["wall_ratios"]]
            ratios[f"{name}, per CPU-s"] = [100 * x for x in pair["cpu_ratios"]]
        panels.append(plots.Panel("Offload / none, paired per pass", "pass", "% of none",
                                  list(range(1, len(result["passes"]) + 1)), ratios,
                                  hlines={f"target {TARGET:.0%}": 100 * TARGET, "100%": 100}))
    elif all("cpu_s" in r for r in runs.values()):
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
    if "passes" in result:  # results from before --repeats predate tail chunks
        text += _passes_sentences(result, stores)
    elif "none" in runs:
        text += _single_pass_sentences(result, stores)
    up_to = "up to " if "passes" in result else ""  # tail chunks are shorter
    copies = [f"{name} saved {runs[name]['saved_chunks']:.0f} chunks of {up_to}{args['chunk_tokens']} tokens and "
              f"copying them out took {runs[name]['save_copy_s']:.2f} s, "
              f"{100 * runs[name]['save_copy_s'] / runs[name]['seconds']:.1f}% of its {runs[name]['seconds']:.0f} s "
              "run" for name in stores]
    if copies:
        median_note = " (medians over the passes)" if "passes" in result else ""
        text += "Where the store's time goes: " + "; ".join(copies) + f"{median_note}. That copy is the only store work " \
                "inside a step; the rest of the difference is the CPU of the write-behind threads (sealing and " \
                "writing), taken from cores the forward keeps busy. "
    resident = [f"{name} in {runs[name]['resident_s']:.1f} s" for name in stores if "resident_s" in runs[name]]
    if resident:
        text += ("Before it was timed, each offload engine faulted in its cpu tier's memory, as `kvtier serve` does "
                 f"at start (median: {', '.join(resident)}); pages first touched during the run cost the forward's "
                 "cores the kernel's zeroing and, on a VM, the host's fault. ")
    return (text + profile_note(result)).strip()


def _passes_sentences(result: dict, stores: list[str]) -> str:
    args, runs, passes = result["args"], result["runs"], result["passes"]
    low, high = length_range(argparse.Namespace(**args))
    tails = median([next(iter(p.values()))["prompts_with_tail"] for p in passes])
    text = (f"Prompt lengths are uniform in [{low}, {high}], so {tails:.0f} of the {args['num_prompts']} prompts "
            f"of a pass end inside a {args['chunk_tokens']}-token chunk, and with a store each of those also copies "
            "out and saves a tail chunk (its full blocks past the last chunk boundary) once its prefill is done. ")
    hits = sum(p[name]["loaded_tokens"] for p in passes for name in stores)
    text += (f"The configurations ran interleaved over {len(passes)} passes, each run on a fresh engine and store "
             f"with the pass's own prompts; the store served {hits:.0f} tokens in all. ")
    if "paired" not in result:
        return text
    for name in stores:
        pair = result["paired"][name]
        wall, cpu = pair["wall_ratio"], pair["cpu_ratio"]
        text += (f"Output tokens/s, median over passes: none {runs['none']['output_tok_s']:.0f}, {name} "
                 f"{runs[name]['output_tok_s']:.0f}. Paired pass by pass, {name} ran at a median {100 * wall:.0f}% "
                 f"of none in wall-clock time (passes {_percents(pair['wall_ratios'])}), "
                 f"{'meeting' if wall >= TARGET else 'missing'} the {TARGET:.0%} target, and at {100 * cpu:.0f}% of "
                 f"none in output tokens per CPU-second (passes {_percents(pair['cpu_ratios'])}), which counts the "
                 "work whatever else runs on the shared cores. ")
        spread = max(pair["wall_ratios"]) - min(pair["wall_ratios"])
        cpu_spread = max(pair["cpu_ratios"]) - min(pair["cpu_ratios"])
        if spread > abs(wall - TARGET):
            text += (f"The wall-clock ratios spread over {100 * spread:.0f} points, more than the median's distance "
                     "to the target: on this machine the noise is as large as the effect" +
                     (f"; the CPU-time ratios, spread over {100 * cpu_spread:.0f}, are the steadier measure of the "
                      "store's cost. " if cpu_spread < spread / 2 else "; more passes (--repeats) narrow the median. "))
    return text


def _percents(values: list[float]) -> str:
    return ", ".join(f"{100 * v:.0f}%" for v in values)


def _single_pass_sentences(result: dict, stores: list[str]) -> str:
    """A result from before --repeats: one run per configuration, one after the other."""
    runs = result["runs"]
    shares = [f"{name} {runs[name]['output_tok_s']:.0f} ({100 * ratio(result, name):.0f}% of none, "
              f"{'meets' if ratio(result, name) >= TARGET else 'misses'} the {TARGET:.0%} target)" for name in stores]
    text = f"Output tokens/s: none {runs['none']['output_tok_s']:.0f}; " + "; ".join(shares) + ". "
    if any(ratio(result, name) > 1 for name in stores):
        text += ("A ratio above 100% is the shared machine drifting between runs made one after the other: "
                 "the store adds work, it cannot remove any. ")
    if all("cpu_s" in r for r in runs.values()):
        cpu = [f"{name} {runs[name]['cpu_s']:.0f} s ({100 * (runs[name]['cpu_s'] / runs['none']['cpu_s'] - 1):+.0f}%)"
               for name in stores]
        text += (f"CPU time, which counts the work whatever else runs: none {runs['none']['cpu_s']:.0f} s, "
                 + ", ".join(cpu) + ". ")
    return text
