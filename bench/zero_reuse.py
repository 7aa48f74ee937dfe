"""Zero reuse: random prompts with no shared prefix at high concurrency, so the store
never serves anything and only costs (lookups, copying chunks out, background writes).
Output tokens/s with offload against the same engine without it (target: >= 97%).
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

from bench.common import machine_info, markdown_table, write_result
from bench.kv_common import STORE_CONFIGS, local_redis, numeric_stats, serve, store_options
from engine import LLM, SamplingParams
from engine.builtin_model import default_model_path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench zero-reuse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint directory (default: the built-in model).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--configs", nargs="+", default=("none", "cpu+disk"), choices=sorted(STORE_CONFIGS))
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--redis-url", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def run(args: argparse.Namespace, model: str, config: str, prompts: list[list[int]], redis_url: str | None) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    llm = LLM(model=model, dtype=args.dtype, max_num_seqs=args.concurrency, kv_chunk_tokens=args.chunk_tokens,
              **store_options(config, workdir, redis_url))
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    try:
        serve(llm.engine, prompts[: args.concurrency], SamplingParams(max_tokens=2), args.concurrency, "warm")
        start = time.perf_counter()
        outputs = serve(llm.engine, prompts[args.concurrency :], params, args.concurrency)
        seconds = time.perf_counter() - start
        stats = numeric_stats(llm.engine)
    finally:
        llm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"seconds": seconds, "output_tokens": tokens, "output_tok_s": tokens / seconds,
            "saved_chunks": stats.get("kv_saved_chunks", 0), "save_copy_s": stats.get("kv_save_copy_seconds", 0.0)}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    model = args.model or default_model_path()
    rng = random.Random(args.seed)
    probe = LLM(model=model, dtype=args.dtype, num_kv_blocks=16)
    vocab = probe.engine.spec.vocab_size
    probe.close()
    total = args.num_prompts + args.concurrency  # the first `concurrency` warm the engine up
    prompts = [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(total)]
    result = {"machine": machine_info(), "args": vars(args), "model": model, "runs": {}}
    needs_redis = any("redis" in STORE_CONFIGS[c] for c in args.configs)
    with local_redis(args.redis_url if needs_redis else "unused") as redis_url:
        for config in args.configs:
            result["runs"][config] = run(args, model, config, prompts, redis_url)
            print(config, result["runs"][config], flush=True)
    text = render(result)
    write_result("zero_reuse", result, text)
    print(text)
    return 0


def render(result: dict) -> str:
    runs = result["runs"]
    base = runs.get("none", {}).get("output_tok_s")
    rows = [[name, r["seconds"], r["output_tok_s"], r["output_tok_s"] / base if base else float("nan"),
             r["saved_chunks"], r["save_copy_s"]] for name, r in runs.items()]
    args = result["args"]
    return (f"Zero reuse: {args['num_prompts']} prompts x {args['prompt_len']} tokens, "
            f"{args['output_len']} output tokens, {args['concurrency']} in flight, {args['dtype']}\n\n"
            + markdown_table(["store", "seconds", "output tok/s", "vs none (target >= 0.97)",
                              "chunks saved", "save copy s"], rows))
