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

from bench.common import machine_info, markdown_table, percentile, write_result
from bench.kv_common import numeric_stats, serve
from engine import LLM, SamplingParams
from engine.builtin_model import default_model_path

MODES = {
    "recompute (no store)": {},
    "recompute + cpu store": {"kv_offload": "cpu", "preemption_mode": "recompute"},
    "offload to cpu": {"kv_offload": "cpu", "preemption_mode": "offload"},
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench preemption", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint directory (default: the built-in model).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--capacity-fraction", type=float, default=0.33,
                   help="Device pool / what `concurrency` requests need at their longest.")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run(args: argparse.Namespace, model: str, options: dict, prompts: list[list[int]]) -> dict:
    need = args.concurrency * (args.prompt_len + args.output_len)
    blocks = math.ceil(need * args.capacity_fraction / 16)
    llm = LLM(model=model, dtype=args.dtype, num_kv_blocks=blocks, max_num_seqs=args.concurrency,
              kv_chunk_tokens=args.chunk_tokens, **options)
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    try:
        start = time.perf_counter()
        outputs = serve(llm.engine, prompts, params, args.concurrency)
        seconds = time.perf_counter() - start
        stats = numeric_stats(llm.engine)
    finally:
        llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    ttfts = [1000 * o.metrics.time_to_first_token for o in outputs]
    return {"seconds": seconds, "output_tok_s": tokens / seconds, "ttft_p50_ms": percentile(ttfts, 50),
            "ttft_p99_ms": percentile(ttfts, 99), "num_kv_blocks": blocks,
            "preemptions": stats["num_preemptions_total"], "recomputed_tokens": stats["num_recomputed_tokens"],
            "offloaded_chunks": stats.get("kv_offloaded_chunks", 0), "loaded_tokens": stats.get("kv_loaded_tokens", 0),
            "outputs": [o.outputs[0].token_ids for o in outputs]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    model = args.model or default_model_path()
    rng = random.Random(args.seed)
    probe = LLM(model=model, dtype=args.dtype, num_kv_blocks=16)
    vocab = probe.engine.spec.vocab_size
    probe.close()
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    result = {"machine": machine_info(), "args": vars(args), "model": model, "runs": {}}
    for name, options in MODES.items():
        result["runs"][name] = run(args, model, options, prompts)
        print(name, {k: v for k, v in result["runs"][name].items() if k != "outputs"}, flush=True)
    outputs = [r.pop("outputs") for r in result["runs"].values()]
    result["identical_outputs"] = sum(all(run[i] == outputs[0][i] for run in outputs) for i in range(len(prompts)))
    text = render(result)
    write_result("preemption", result, text)
    print(text)
    return 0


def render(result: dict) -> str:
    rows = [[name, r["seconds"], r["output_tok_s"], r["ttft_p50_ms"], r["ttft_p99_ms"], r["preemptions"],
             r["recomputed_tokens"], r["offloaded_chunks"], r["loaded_tokens"]] for name, r in result["runs"].items()]
    args = result["args"]
    return (f"Preemption: {args['num_prompts']} requests ({args['prompt_len']} + {args['output_len']} tokens), "
            f"{args['concurrency']} in flight, device pool {args['capacity_fraction']:.0%} of their need, "
            f"{args['dtype']}; requests with identical outputs in every mode: "
            f"{result['identical_outputs']}/{args['num_prompts']} (bf16 greedy tokens depend on how the "
            f"batch was shaped when the KV was computed; fp32 runs agree)\n\n"
            + markdown_table(["mode", "seconds", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "preemptions",
                              "recomputed tok", "offloaded chunks", "loaded tok"], rows))
