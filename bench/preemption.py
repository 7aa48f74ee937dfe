"""Preemption beyond KV capacity: more requests in flight than the device pool holds.
Offload mode (a preempted request's computed chunks go to the cpu tier and are loaded
back) against recompute mode, with and without a store: throughput, TTFT p99,
preemptions and recomputed tokens.
"""

from __future__ import annotations

import argparse
import math
import random
import time

from bench import plots
from bench.common import markdown_table, parse_with_smoke, percentile, smoke_engine_options
from bench.kv_common import numeric_stats, serve
from bench.profiling import profile_note, profile_requests, profile_tables
from bench.summary import checkpoint, publish, run_stamp, workload_parser
from bench.text_corpus import CorpusTokens
from engine import LLM, SamplingParams

NAME = "preemption"
RECOMPUTE, OFFLOAD = "recompute (no store)", "offload to cpu"
MODES = {
    RECOMPUTE: {},
    "recompute + cpu store": {"kv_offload": "cpu", "preemption_mode": "recompute"},
    OFFLOAD: {"kv_offload": "cpu", "preemption_mode": "offload"},
}


SMOKE = {"num_prompts": 3, "prompt_len": 32, "output_len": 8, "concurrency": 3, "capacity_fraction": 0.5,
         "chunk_tokens": 16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "one wave of requests in recompute mode")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--capacity-fraction", type=float, default=0.33,
                   help="Device pool / what `concurrency` requests need at their longest.")
    p.add_argument("--chunk-tokens", type=int, default=256)
    return parse_with_smoke(p, argv, SMOKE)


def make_prompts(args: argparse.Namespace, corpus: CorpusTokens) -> list[list[int]]:
    """Prompts of real text, each from its own point of the corpus."""
    rng = random.Random(args.seed)
    return [corpus.take(rng, args.prompt_len) for _ in range(args.num_prompts)]


def mode_llm(args: argparse.Namespace, model: str, options: dict) -> LLM:
    """An engine whose pool holds --capacity-fraction of what `concurrency` requests need."""
    need = args.concurrency * (args.prompt_len + args.output_len)
    return LLM(model=model, dtype=args.dtype, num_kv_blocks=math.ceil(need * args.capacity_fraction / 16),
               max_num_seqs=args.concurrency, kv_chunk_tokens=args.chunk_tokens, **options,
               **smoke_engine_options(args))


def run(args: argparse.Namespace, model: str, options: dict, prompts: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with mode_llm(args, model, options) as llm:
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = serve(llm.engine, prompts, params, args.concurrency)
        seconds, cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
        stats = numeric_stats(llm.engine)
        blocks = llm.engine.config.num_kv_blocks
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [1000 * o.metrics.time_to_first_token for o in outputs]
    return {"seconds": seconds, "cpu_s": cpu_s, "output_tok_s": tokens / seconds, "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p99_ms": percentile(ttfts, 99), "num_kv_blocks": blocks,
            "preemptions": stats["num_preemptions_total"], "recomputed_tokens": stats["num_recomputed_tokens"],
            "offloaded_chunks": stats.get("kv_offloaded_chunks", 0), "loaded_tokens": stats.get("kv_loaded_tokens", 0),
            "outputs": [o.outputs[0].token_ids for o in outputs]}


def profile(args: argparse.Namespace, model: str, prompts: list[list[int]]) -> dict:
    """The slowest path: a wave of `concurrency` requests in recompute mode without a
    store, the pool too small for them, so preempted requests compute their tokens again."""
    with mode_llm(args, model, MODES[RECOMPUTE]) as llm:
        return profile_requests(llm, prompts[: args.concurrency], args.output_len,
                                f"{args.concurrency} requests at once, recompute preemption")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    model, _ = checkpoint(args)
    prompts = make_prompts(args, CorpusTokens.for_model(model))
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": model, "runs": {}}
    for name, options in MODES.items():
        result["runs"][name] = run(args, model, options, prompts)
        print(name, {k: v for k, v in result["runs"][name].items() if k != "outputs"}, flush=True)
    outputs = [r.pop("outputs") for r in result["runs"].values()]
    result["identical_outputs"] = sum(all(run[i] == outputs[0][i] for run in outputs) for i in range(len(prompts)))
    if args.profile:
        result["profile"] = profile(args, model, prompts)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    rows = [[name, r["seconds"], r.get("cpu_s", "n/a"), r["output_tok_s"], r["ttft_p50_ms"], r["ttft_p99_ms"],
             r["preemptions"], r["recomputed_tokens"], r["offloaded_chunks"], r["loaded_tokens"]]
            for name, r in result["runs"].items()]
    args = result["args"]
    text = (f"Preemption: {args['num_prompts']} requests ({args['prompt_len']} + {args['output_len']} tokens), "
            f"{args['concurrency']} in flight, device pool {args['capacity_fraction']:.0%} of their need, "
            f"{args['dtype']}; requests with identical outputs in every mode: "
            f"{result['identical_outputs']}/{args['num_prompts']} (bf16 greedy tokens depend on how the "
            f"batch was shaped when the KV was computed; fp32 runs agree)\n\n"
            + markdown_table(["mode", "seconds", "CPU s", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "preemptions",
                              "recomputed tok", "offloaded chunks", "loaded tok"], rows))
    return text + profile_tables(result)


def plot(result: dict) -> None:
    runs = result["runs"]
    modes = list(runs)
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Output throughput", "preemption mode", "output tokens/s", modes,
                    plots.columns(runs, {"output tok/s": "output_tok_s"}), kind="bar"),
        plots.Panel("Time to first token", "preemption mode", "ms", modes,
                    plots.columns(runs, {"p50": "ttft_p50_ms", "p99": "ttft_p99_ms"}), kind="bar"),
        plots.Panel("KV needed again after preemption", "preemption mode", "tokens", modes,
                    plots.columns(runs, {"recomputed": "recomputed_tokens", "loaded from the store": "loaded_tokens"}),
                    kind="bar"),
    ], "Preemption beyond KV capacity: offload vs recompute")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    args, runs = result["args"], result["runs"]
    recompute, offload = runs[RECOMPUTE], runs[OFFLOAD]
    need = args["concurrency"] * (args["prompt_len"] + args["output_len"])
    text = (f"{args['concurrency']} requests in flight need up to {need} tokens of KV; the device pool holds "
            f"{16 * recompute['num_kv_blocks']} ({args['capacity_fraction']:.0%}), so the scheduler preempts the "
            f"most recently admitted running request when a step cannot get blocks (preemptions per mode: "
            + ", ".join(f"{name} {r['preemptions']}" for name, r in runs.items()) + "). ")
    text += ("A preempted request comes back later and needs its KV again: " + "; ".join(
        f"{name} recomputed {r['recomputed_tokens']} tokens and loaded {r['loaded_tokens']} from the store"
        for name, r in runs.items()) + ". ")
    text += (f"Every full prompt chunk is saved when the prefill completes it, so with a store a resumed request "
             "loads its prompt and recomputes only the tokens generated since; offload mode also saves those, "
             f"the victim's computed chunks ({offload['offloaded_chunks']} chunks of {args['chunk_tokens']} tokens), "
             "before its blocks are freed. ")
    text += (f"Against recompute without a store, offload mode ran at {offload['output_tok_s']:.0f} vs "
             f"{recompute['output_tok_s']:.0f} output tok/s ({offload['output_tok_s'] / recompute['output_tok_s']:.2f}x) "
             f"with TTFT p99 {offload['ttft_p99_ms']:.0f} vs {recompute['ttft_p99_ms']:.0f} ms. ")
    if "cpu_s" in recompute and "cpu_s" in offload:
        text += f"CPU time: {offload['cpu_s']:.1f} vs {recompute['cpu_s']:.1f} s. "
    prompt_tokens = args["num_prompts"] * args["prompt_len"]
    text += (f"What preemption costs: recomputed tokens are prefill work on top of the {prompt_tokens} prompt tokens ("
             + ", ".join(f"{100 * r['recomputed_tokens'] / prompt_tokens:.0f}% {name}" for name, r in runs.items())
             + "); TTFT counts from when a request enters the engine, so it also holds the wait for blocks that "
             "the running requests hold. ")
    return (text + profile_note(result)).strip()
