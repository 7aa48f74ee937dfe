"""Eviction policies of the cpu and disk tiers (--kv-offload-eviction lru|arc) on two
workloads, each tier sized to hold half of the documents:

  thrash  --num-docs documents in order, twice: by the time a document comes back, the
          tier has held the whole other half since (the LRU-thrash replay);
  mix     --hot-docs hot documents, asked twice to begin with (a one-off document after
          each pass, so that the second ask is a tier hit, not a device one), then each
          coming back --mix-rounds times, every time after --one-offs-per-hot documents
          seen once. Between two asks of a hot document more documents pass than the
          tier holds.

Round 1 is the warm-up (thrash: the first pass; mix: the hot documents twice),
round 2 is measured: the share of its prompt tokens the tier served (hit rate) and its
TTFT. One engine per policy and tier, each with a device pool of about one request
(so that what comes back comes from the tier, not the device's prefix cache), fresh for
each workload; every request is served by every engine in turn and the store drained
after it, so that a hit does not depend on how far the write-behind got, and so that
each ARC/LRU TTFT ratio pairs two runs of the same request a moment apart.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import tempfile
from pathlib import Path
from statistics import mean

from bench import plots
from bench.common import markdown_table, median, parse_with_smoke, percentile, smoke_engine_options
from bench.kv_common import delta, hit_tokens, numeric_stats, serve
from bench.summary import checkpoint, publish, run_stamp, workload_parser
from bench.text_corpus import token_documents
from engine import LLM, SamplingParams
from tiers.eviction import EVICTION_POLICIES

NAME = "eviction"
WORKLOADS = ("thrash", "mix")
BLOCK_SIZE = 16
QUESTION = "\n\nQuestion: summarize this document in one sentence."
SMOKE = {"num_docs": 4, "doc_tokens": 64, "chunk_tokens": 32, "hot_docs": 1, "one_offs_per_hot": 2,
         "mix_rounds": 2, "max_tokens": 2}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "nothing (no profile run)")
    p.add_argument("--num-docs", type=int, default=8, help="Documents of the thrash workload; the tiers hold half.")
    p.add_argument("--doc-tokens", type=int, default=512, help="Tokens per document (a multiple of --chunk-tokens).")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--hot-docs", type=int, default=2)
    p.add_argument("--one-offs-per-hot", type=int, default=2, help="Documents seen once after each hot one.")
    p.add_argument("--mix-rounds", type=int, default=2, help="Times each hot document comes back in round 2.")
    p.add_argument("--max-tokens", type=int, default=2, help="Answer length.")
    p.add_argument("--tiers", nargs="+", default=["cpu", "disk"], choices=("cpu", "disk"))
    args = parse_with_smoke(p, argv, SMOKE)
    if args.doc_tokens % args.chunk_tokens:
        p.error("--doc-tokens must be a multiple of --chunk-tokens")
    if args.hot_docs * (args.one_offs_per_hot + 1) - 1 < capacity_docs(args):
        p.error("a hot document would come back before the tier filled: raise --one-offs-per-hot")
    if args.hot_docs >= capacity_docs(args):
        p.error("the tier must hold more than the hot documents: raise --num-docs or lower --hot-docs")
    return args


def capacity_docs(args: argparse.Namespace) -> int:
    return max(1, args.num_docs // 2)


# ---- the two request sequences ---------------------------------------------------------------


def sequences(args: argparse.Namespace) -> dict[str, tuple[list[int], list[int]]]:
    """Per workload, the document indices of round 1 and of round 2."""
    thrash = list(range(args.num_docs))
    hot = list(range(args.hot_docs))
    one_offs = iter(range(args.hot_docs, doc_count(args)))
    warm = [*hot, next(one_offs), *hot, next(one_offs)]
    measured = []
    for _ in range(args.mix_rounds):
        for doc in hot:
            measured += [next(one_offs) for _ in range(args.one_offs_per_hot)]
            measured.append(doc)
    return {"thrash": (thrash, thrash), "mix": (warm, measured)}


def doc_count(args: argparse.Namespace) -> int:
    mix = args.hot_docs + 2 + args.mix_rounds * args.hot_docs * args.one_offs_per_hot
    return max(args.num_docs, mix)


# ---- engines -------------------------------------------------------------------------------------


def record_sizes(args: argparse.Namespace, model: str, pool: int) -> tuple[int, int]:
    """Bytes of one record in a cpu slot and in a disk file, from a store of the run's shape."""
    llm = LLM(model=model, dtype=args.dtype, num_kv_blocks=pool, kv_offload="cpu",
              kv_offload_cpu_size="64MiB", kv_chunk_tokens=args.chunk_tokens, **smoke_engine_options(args))
    try:
        store = llm.engine.connector.store
        return store.host.slot_bytes, store.codec.max_record_size
    finally:
        llm.close()


def device_blocks(args: argparse.Namespace, prompt_tokens: int) -> int:
    """A device pool of one request: the next request takes every block of the one
    before, so what comes back is not in the device's prefix cache any more."""
    return math.ceil((prompt_tokens + args.max_tokens) / BLOCK_SIZE)


def build_engines(args: argparse.Namespace, model: str, workdir: Path, sizes: tuple[int, int],
                  pool: int, prompt_tokens: int) -> dict[str, LLM]:
    # a prompt's records: its full chunks and a tail record of its full blocks past them
    saved_tokens = prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    records = capacity_docs(args) * math.ceil(saved_tokens / args.chunk_tokens)
    engines = {}
    for tier in args.tiers:
        for policy in EVICTION_POLICIES:
            size = {"kv_offload_cpu_size": f"{records * sizes[0]}B"} if tier == "cpu" else {
                "kv_offload_disk_size": f"{records * sizes[1]}B",
                "kv_offload_disk_path": str(workdir / f"{policy}-disk")}
            engines[f"{tier} {policy}"] = LLM(
                model=model, dtype=args.dtype, num_kv_blocks=pool, block_size=BLOCK_SIZE, max_num_seqs=1,
                kv_offload=tier, kv_offload_eviction=policy, kv_chunk_tokens=args.chunk_tokens,
                **size, **smoke_engine_options(args))
    return engines


def run_workload(args: argparse.Namespace, model: str, prompts: list[list[int]], rounds: tuple[list[int], list[int]],
                 sizes: tuple[int, int], pool: int) -> dict[str, list[dict]]:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-eviction-"))
    engines = build_engines(args, model, workdir, sizes, pool, len(prompts[0]))
    out: dict[str, list[dict]] = {name: [] for name in engines}
    try:
        for number, order in enumerate(rounds, 1):
            before = {name: numeric_stats(llm.engine) for name, llm in engines.items()}
            ttfts: dict[str, list[float]] = {name: [] for name in engines}
            for n, doc in enumerate(order):
                for name, llm in engines.items():
                    result = serve(llm.engine, [prompts[doc]], params, 1, tag=f"r{number}-{n}")[0]
                    ttfts[name].append(1000 * result.metrics.time_to_first_token)
                    llm.engine.connector.store.drain(60)
            for name, llm in engines.items():
                hits = hit_tokens(delta(before[name], numeric_stats(llm.engine)))
                tier = name.split()[0]
                out[name].append({"round": number, "docs": order, "ttft_ms": ttfts[name],
                                  "ttft_p50_ms": percentile(ttfts[name], 50), "hits": hits,
                                  "hit_rate": hits[tier] / sum(len(prompts[doc]) for doc in order)})
    finally:
        for llm in engines.values():
            with contextlib.suppress(Exception):
                llm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return out


# ---- main and report -----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    model, _ = checkpoint(args)
    probe = LLM(model=model, dtype=args.dtype, num_kv_blocks=16, **smoke_engine_options(args))
    question = probe.engine.tokenizer.encode(QUESTION, add_special_tokens=False)
    docs = token_documents(probe.engine.tokenizer, [args.doc_tokens] * doc_count(args), seed=args.seed)
    probe.close()
    prompts = [doc + question for doc in docs]
    pool = device_blocks(args, len(prompts[0]))
    sizes = record_sizes(args, model, pool)
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": model, "record_bytes": sizes,
              "capacity_docs": capacity_docs(args), "workloads": {}}
    for workload, rounds in sequences(args).items():
        result["workloads"][workload] = run_workload(args, model, prompts, rounds, sizes, pool)
    result["ratios"] = ratios(result, args.tiers)
    plot(result)
    publish(NAME, result, render(result))
    return 0


def ratios(result: dict, tiers: list[str]) -> dict[str, dict[str, float]]:
    """Per workload and tier, the median over round 2's requests of ARC's TTFT over LRU's."""
    out: dict[str, dict[str, float]] = {}
    for workload, engines in result["workloads"].items():
        for tier in tiers:
            arc, lru = engines[f"{tier} arc"][-1]["ttft_ms"], engines[f"{tier} lru"][-1]["ttft_ms"]
            out.setdefault(workload, {})[tier] = median([a / b for a, b in zip(arc, lru, strict=True)])
    return out


def render(result: dict) -> str:
    args = result["args"]
    text = (f"Eviction policies: documents of {args['doc_tokens']} tokens, {args['chunk_tokens']}-token records, "
            f"each tier holding {result['capacity_docs']} documents; thrash: {args['num_docs']} documents twice; "
            f"mix: {args['hot_docs']} hot documents, each back {args['mix_rounds']} times after "
            f"{args['one_offs_per_hot']} one-off documents; {args['dtype']}, one request at a time\n\n")
    rows = []
    for workload, engines in result["workloads"].items():
        for name, records in engines.items():
            measured = records[-1]
            tier, policy = name.split()
            ratio = result["ratios"][workload][tier] if policy == "arc" else 1.0
            rows.append([workload, tier, policy, f"{measured['hit_rate']:.0%}", measured["ttft_p50_ms"],
                         mean(measured["ttft_ms"]), f"{ratio:.2f}", measured["hits"][tier], measured["hits"]["device"]])
    return text + markdown_table(["workload", "tier", "eviction", "round-2 hit rate", "round-2 TTFT p50 ms",
                                  "TTFT mean ms", "TTFT / LRU's (paired p50)", "tier hit tok", "device hit tok"], rows)


def plot(result: dict) -> None:
    names = [name for name in next(iter(result["workloads"].values()))]
    hit_rates = {w: [100 * result["workloads"][w][n][-1]["hit_rate"] for n in names] for w in result["workloads"]}
    ttfts = {w: [result["workloads"][w][n][-1]["ttft_p50_ms"] for n in names] for w in result["workloads"]}
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Round-2 hit rate", "tier and eviction policy", "% of prompt tokens", names, hit_rates,
                    kind="bar"),
        plots.Panel("Round-2 TTFT (p50)", "tier and eviction policy", "ms", names, ttfts, kind="bar"),
    ], "LRU against ARC, tiers holding half of the documents")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    parts, rates = [], {}
    for workload, engines in result["workloads"].items():
        for tier, ratio in result["ratios"][workload].items():
            lru, arc = engines[f"{tier} lru"][-1], engines[f"{tier} arc"][-1]
            rates[workload, tier] = lru["hit_rate"], arc["hit_rate"]
            parts.append(f"{workload}, {tier}: hit rate {lru['hit_rate']:.0%} with LRU, {arc['hit_rate']:.0%} with "
                         f"ARC; TTFT mean {mean(lru['ttft_ms']):.0f} and {mean(arc['ttft_ms']):.0f} ms, p50 "
                         f"{lru['ttft_p50_ms']:.0f} and {arc['ttft_p50_ms']:.0f} ms (ARC/LRU per request, median "
                         f"{ratio:.2f}x)")
    text = "Round 2, per workload and tier: " + "; ".join(parts) + "."
    thrash = [pair for (workload, _), pair in rates.items() if workload == "thrash"]
    if all(max(pair) == 0 for pair in thrash):
        text += (" On the thrash replay neither policy keeps anything: each document is evicted just before it "
                 "comes back, and ARC's ghost hits only move documents from one of its lists to the other.")
    elif all(lru == 0 for lru, _ in thrash):
        text += (" On the thrash replay LRU evicts each document just before it comes back; ARC keeps some: the "
                 "first documents to return are ghost hits that raise its recency target, so it stops evicting "
                 "the recency list and the last documents of the cycle are still there when they return.")
    if all(arc > lru for (workload, _), (lru, arc) in rates.items() if workload == "mix"):
        text += (" On the mix ARC keeps the hot documents in its frequency list, which the one-off documents do not "
                 "reach, so they come back from the tier instead of being computed again wherever LRU has evicted "
                 "them by then.")
    return text
