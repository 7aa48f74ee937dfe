"""Cross-instance sharing through Redis: instance A serves documents and saves their
chunks to Redis; instance B, a second engine with its own device pool and store
(nothing shared with A but Redis), then serves questions on the same documents, and on
documents nobody saw (cold). Reports B's TTFT on both and what Redis served.
"""

from __future__ import annotations

import argparse
import random

from bench.common import machine_info, markdown_table, percentile, write_result
from bench.kv_common import delta, flush_redis, hit_tokens, local_redis, numeric_stats, serve
from engine import LLM, SamplingParams
from engine.builtin_model import default_model_path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench cross-instance", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint directory (default: the built-in model).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-docs", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=5000)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--tiers", default="redis", help="Store tiers of both instances (must include redis).")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--redis-url", default=None, help="Default: a private redis-server on loopback.")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def instance(args: argparse.Namespace, model: str, redis_url: str) -> LLM:
    return LLM(model=model, dtype=args.dtype, kv_offload=args.tiers, kv_redis_url=redis_url,
               kv_chunk_tokens=args.chunk_tokens, max_num_seqs=1)


def timed_round(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict:
    before = numeric_stats(llm.engine)
    outputs = serve(llm.engine, prompts, params, 1, tag)
    ttfts = [1000 * o.metrics.time_to_first_token for o in outputs]
    return {"ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "hits": hit_tokens(delta(before, numeric_stats(llm.engine)))}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    model = args.model or default_model_path()
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    result = {"machine": machine_info(), "args": vars(args), "model": model}
    with local_redis(args.redis_url) as redis_url:
        flush_redis(redis_url)
        writer = instance(args, model, redis_url)
        vocab = writer.engine.spec.vocab_size

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        shared = [tokens(args.doc_tokens) for _ in range(args.num_docs)]
        cold = [tokens(args.doc_tokens) for _ in range(args.num_docs)]
        result["instance_a"] = timed_round(writer, [d + tokens(args.question_tokens) for d in shared], params, "a")
        writer.close()  # writes out every pending save
        reader = instance(args, model, redis_url)
        result["b_shared"] = timed_round(reader, [d + tokens(args.question_tokens) for d in shared], params, "b")
        result["b_cold"] = timed_round(reader, [d + tokens(args.question_tokens) for d in cold], params, "c")
        reader.close()
    text = render(result)
    write_result("cross_instance", result, text)
    print(text)
    return 0


def render(result: dict) -> str:
    args = result["args"]
    rows = [[name, r["ttft_p50_ms"], r["ttft_p99_ms"], r["hits"]["redis"], r["hits"]["cpu"]]
            for name, r in (("A (computes, saves)", result["instance_a"]),
                            ("B on A's documents", result["b_shared"]), ("B on new documents (cold)", result["b_cold"]))]
    speedup = result["b_cold"]["ttft_p50_ms"] / result["b_shared"]["ttft_p50_ms"]
    return (f"Cross-instance via {args['tiers']}: {args['num_docs']} docs x {args['doc_tokens']} tokens, "
            f"{args['dtype']}; B's TTFT p50 cold / shared = {speedup:.1f}x\n\n"
            + markdown_table(["run", "TTFT p50 ms", "TTFT p99 ms", "redis tok", "cpu tok"], rows))
