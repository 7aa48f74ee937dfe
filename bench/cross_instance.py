"""Cross-instance sharing through Redis: instance A serves documents and saves their
chunks to Redis; instance B, a second engine with its own device pool and store
(nothing shared with A but Redis), then serves questions on the same documents, and on
documents nobody saw (cold). Reports B's TTFT on both and what Redis served.
"""

from __future__ import annotations

import argparse
import random

from bench import plots
from bench.common import markdown_table, parse_with_smoke, percentile, smoke_engine_options
from bench.kv_common import delta, flush_redis, hit_tokens, local_redis, numeric_stats, serve
from bench.profiling import profile_note, profile_requests, profile_tables
from bench.summary import checkpoint, publish, run_stamp, workload_parser
from bench.text_corpus import CorpusTokens, token_documents
from engine import LLM, SamplingParams

NAME = "cross-instance"
ROWS = {"instance_a": "A (computes, saves)", "b_shared": "B on A's documents", "b_cold": "B on new documents (cold)"}
AXIS = {"instance_a": "A", "b_shared": "B, A's documents", "b_cold": "B, new documents"}  # plot labels


SMOKE = {"num_docs": 2, "doc_tokens": 64, "question_tokens": 4, "max_tokens": 2, "chunk_tokens": 16}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "a new document on instance B")
    p.add_argument("--num-docs", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=5000)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--tiers", default="redis", help="Store tiers of both instances (must include redis).")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--redis-url", default=None, help="Default: a private redis-server on loopback.")
    return parse_with_smoke(p, argv, SMOKE)


def instance(args: argparse.Namespace, model: str, redis_url: str) -> LLM:
    return LLM(model=model, dtype=args.dtype, kv_offload=args.tiers, kv_redis_url=redis_url,
               kv_chunk_tokens=args.chunk_tokens, max_num_seqs=1, **smoke_engine_options(args))


def timed_round(llm: LLM, prompts: list[list[int]], params: SamplingParams, tag: str) -> dict:
    before = numeric_stats(llm.engine)
    outputs = serve(llm.engine, prompts, params, 1, tag)
    ttfts = [1000 * o.metrics.time_to_first_token for o in outputs]
    return {"ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
            "hits": hit_tokens(delta(before, numeric_stats(llm.engine)))}


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    model, _ = checkpoint(args)
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": model}
    with local_redis(args.redis_url) as redis_url:
        flush_redis(redis_url)
        writer = instance(args, model, redis_url)
        result["kv_bytes_per_token"] = writer.engine.block_bytes // writer.engine.config.block_size
        tokenizer = writer.engine.tokenizer
        corpus, rng = CorpusTokens(tokenizer), random.Random(args.seed)
        lengths = [args.doc_tokens] * (2 * args.num_docs) + [args.doc_tokens + args.question_tokens]
        docs = token_documents(tokenizer, lengths, seed=args.seed)  # disjoint runs of real text
        shared, cold, unseen = docs[: args.num_docs], docs[args.num_docs : -1], docs[-1]

        def asked(doc_list: list[list[int]]) -> list[list[int]]:
            return [doc + corpus.take(rng, args.question_tokens) for doc in doc_list]

        result["instance_a"] = timed_round(writer, asked(shared), params, "a")
        writer.close()  # writes out every pending save
        with instance(args, model, redis_url) as reader:
            result["b_shared"] = timed_round(reader, asked(shared), params, "b")
            result["b_cold"] = timed_round(reader, asked(cold), params, "c")
            if args.profile:  # the slowest path: a document nobody saw, computed and saved
                result["profile"] = profile_requests(reader, [unseen], args.max_tokens,
                                                     "a new document on instance B")
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    args = result["args"]
    rows = [[label, result[key]["ttft_p50_ms"], result[key]["ttft_p99_ms"], result[key]["hits"]["redis"],
             result[key]["hits"]["cpu"]] for key, label in ROWS.items()]
    speedup = result["b_cold"]["ttft_p50_ms"] / result["b_shared"]["ttft_p50_ms"]
    text = (f"Cross-instance via {args['tiers']}: {args['num_docs']} docs x {args['doc_tokens']} tokens, "
            f"{args['dtype']}; B's TTFT p50 cold / shared = {speedup:.1f}x\n\n"
            + markdown_table(["run", "TTFT p50 ms", "TTFT p99 ms", "redis tok", "cpu tok"], rows))
    return text + profile_tables(result)


def plot(result: dict) -> None:
    runs = {label: result[key] for key, label in AXIS.items()}
    args = result["args"]
    prompt = args["num_docs"] * (args["doc_tokens"] + args["question_tokens"])
    loaded = {"from Redis": [r["hits"]["redis"] for r in runs.values()],
              "computed": [prompt - sum(r["hits"].values()) for r in runs.values()]}
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Time to first token", "", "ms", list(runs),
                    plots.columns(runs, {"p50": "ttft_p50_ms", "p99": "ttft_p99_ms"}), kind="bar", logy=True),
        plots.Panel("Where the prompt tokens came from", "", "tokens", list(runs), loaded, kind="bar"),
    ], f"Cross-instance sharing through {args['tiers']}")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    args, shared, cold = result["args"], result["b_shared"], result["b_cold"]
    per_doc = shared["hits"]["redis"] / args["num_docs"]
    text = (f"B shares nothing with A but Redis: on A's {args['num_docs']} documents it loaded {per_doc:.0f} of each "
            f"prompt's {args['doc_tokens'] + args['question_tokens']} tokens from Redis (whole "
            f"{args['chunk_tokens']}-token chunks, up to the last full chunk of the document) and computed the rest, "
            f"so its TTFT p50 was {shared['ttft_p50_ms']:.0f} ms against {cold['ttft_p50_ms']:.0f} ms on documents "
            f"nobody saw ({cold['ttft_p50_ms'] / shared['ttft_p50_ms']:.1f}x), which it computed whole, as A did "
            f"for its documents ({result['instance_a']['ttft_p50_ms']:.0f} ms; the saves to Redis run behind). ")
    computed = args["doc_tokens"] + args["question_tokens"] - per_doc
    per_token_ms = cold["ttft_p50_ms"] / (args["doc_tokens"] + args["question_tokens"])
    load_ms = shared["ttft_p50_ms"] - computed * per_token_ms
    if load_ms > 0:
        text += (f"Where B's time goes on a shared document: if the {computed:.0f} tokens it computed cost a cold "
                 f"prompt's average {per_token_ms:.2f} ms per token, loading the other {per_doc:.0f} took about "
                 f"{load_ms:.0f} ms, against about {per_doc * per_token_ms:.0f} ms to compute them")
        if "kv_bytes_per_token" in result:
            megabytes = per_doc * result["kv_bytes_per_token"] / 1e6
            text += f" ({megabytes:.3g} MB of KV, an effective {megabytes / load_ms:.3g} GB/s from Redis)"
        text += ". "
    return (text + profile_note(result)).strip()
