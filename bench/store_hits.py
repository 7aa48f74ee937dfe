"""Store hits against device hits: the TTFT of a request whose KV comes from the cpu, disk
or Redis tier over the TTFT of the same request when the device cache holds it.

N documents of real text (the plain-text pydoc of standard-library modules, memory
addresses stripped), each a prompt of D tokens plus a short question. Every engine has a
device pool of about half the documents (--pool-fraction), except the reference
("device-hit"), whose pool holds them all. Three rounds, documents in order:
  1. first: each document with its question (computed everywhere, saved to the stores);
  2. replay: the same prompts again; each document was evicted from the device by the
     ones after it, so a store engine loads it from its tier, the reference hits;
  3. new question: each document with another question, so only the document's blocks
     are shared (the record holding its last blocks is read in part).
Then a second instance per shared tier ("disk, 2nd instance", "redis, 2nd instance"): a
new engine with its own device pool, on the first one's directory or Redis, serving
rounds 2 and 3 (for it, everything comes from the store). One request at a time; each
request is served by every engine in turn, so each ratio pairs two TTFTs of the same
request a moment apart (the medians of the per-request ratios are what the targets are
about) and the ratios hold on a machine whose speed drifts.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import tempfile
from pathlib import Path

from bench import plots
from bench.common import markdown_table, median, parse_with_smoke, percentile, smoke_engine_options
from bench.kv_common import (
    delta,
    drop_page_cache,
    flush_redis,
    hit_tokens,
    local_redis,
    numeric_stats,
    serve,
)
from bench.summary import checkpoint, publish, run_stamp, workload_parser
from bench.text_corpus import module_text, passage_tokens
from engine import LLM, SamplingParams

NAME = "store-hits"
REFERENCE = "device-hit"
ROUNDS = ("first", "replay", "new question")
TARGETS = {  # store-hit TTFT / device-hit TTFT of the same request, median
    "replay": {"cpu": 1.15, "disk": 1.3, "redis": 1.4},
    "new question": {"cpu": 1.25, "disk": 1.5, "redis": 1.6},
}
MODULES = ("json", "argparse", "pathlib", "logging", "collections", "itertools", "functools",
           "subprocess", "threading", "asyncio", "datetime", "textwrap", "shutil", "random")
QUESTIONS = ("Question: which functions does this module define, and what does the first one return?",
             "Question: summarize in one sentence what this module is for.")
WARM_UP_TOKENS = 256
CPU_TIER_SIZE = "1GiB"  # every document's records, with room to spare


SMOKE = {"num_docs": 2, "doc_tokens": 64, "max_tokens": 2, "chunk_tokens": 32}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "nothing (no profile run)")
    p.add_argument("--num-docs", type=int, default=8)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=4, help="Answer length.")
    p.add_argument("--pool-fraction", type=float, default=0.5,
                   help="Device pool of the store engines / the tokens of all documents.")
    p.add_argument("--tiers", nargs="+", default=["cpu", "disk", "redis"], choices=("cpu", "disk", "redis"))
    p.add_argument("--no-offload", action="store_true", help="Also serve without any store (recomputes).")
    p.add_argument("--second-instance", action=argparse.BooleanOptionalAction, default=True,
                   help="Rounds 2 and 3 from a second engine on the shared disk directory and Redis.")
    p.add_argument("--drop-page-cache", action="store_true",
                   help="Evict the disk records from the page cache before rounds 2 and 3.")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--redis-url", default=None, help="Default: a private redis-server on loopback.")
    return parse_with_smoke(p, argv, SMOKE)


# ---- workload ------------------------------------------------------------------------------


def make_documents(llm: LLM, args: argparse.Namespace) -> tuple[list[list[int]], list[list[int]]]:
    """Documents of exactly --doc-tokens tokens of real text, and the token ids of the
    questions (one per round after the first kind)."""
    tokenizer = llm.engine.tokenizer
    docs = []
    for name in MODULES:
        ids = tokenizer.encode(f"Documentation of the Python module {name}:\n\n{module_text(name)}")
        if len(ids) >= args.doc_tokens:
            docs.append(ids[: args.doc_tokens])
        if len(docs) == args.num_docs:
            break
    if len(docs) < args.num_docs:
        raise SystemExit(f"only {len(docs)} standard-library modules have {args.doc_tokens} tokens of pydoc")
    questions = [tokenizer.encode("\n\n" + q, add_special_tokens=False) for q in QUESTIONS]
    return docs, questions


def round_prompts(docs: list[list[int]], questions: list[list[int]], index: int) -> list[list[int]]:
    question = questions[1] if ROUNDS[index] == "new question" else questions[0]
    return [doc + question for doc in docs]


def pool_blocks(args: argparse.Namespace, fraction: float) -> int:
    """Device blocks for `fraction` of the documents (with their questions and answers)."""
    per_request = args.doc_tokens + 64 + args.max_tokens
    return math.ceil(args.num_docs * per_request * fraction / 16)


# ---- engines ---------------------------------------------------------------------------------


class Engines:
    """Every engine of the run, by name, closed together."""

    def __init__(self, args: argparse.Namespace, model: str, workdir: Path, redis_url: str | None) -> None:
        self.args, self.model, self.workdir, self.redis_url = args, model, workdir, redis_url
        self.engines: dict[str, LLM] = {}
        self.add(REFERENCE, pool=1.1)
        if args.no_offload:
            self.add("none")
        for tier in args.tiers:
            self.add(tier, kv_offload=tier, **self.tier_options(tier))

    def tier_options(self, tier: str) -> dict:
        if tier == "disk":
            return {"kv_offload_disk_path": str(self.workdir / "disk")}
        if tier == "redis":
            return {"kv_redis_url": self.redis_url}
        return {"kv_offload_cpu_size": CPU_TIER_SIZE}

    def add(self, name: str, pool: float | None = None, **options) -> None:
        blocks = pool_blocks(self.args, pool or self.args.pool_fraction)
        llm = LLM(model=self.model, dtype=self.args.dtype, num_kv_blocks=blocks, max_num_seqs=1,
                  kv_chunk_tokens=self.args.chunk_tokens, **smoke_engine_options(self.args), **options)
        length = min(WARM_UP_TOKENS, self.args.doc_tokens)
        warm_up = [passage_tokens(llm.engine.tokenizer, length, seed=-i) for i in (1, 2)]
        serve(llm.engine, warm_up, SamplingParams(max_tokens=2, temperature=0.0), 1, tag="warm-up")
        self.engines[name] = llm

    def add_second_instances(self) -> None:
        for tier in ("disk", "redis"):
            if tier in self.args.tiers:
                self.engines[tier].engine.connector.store.drain(60)
                self.add(f"{tier}, 2nd instance", kv_offload=tier, **self.tier_options(tier))

    def close(self) -> None:
        for llm in self.engines.values():
            llm.close()


def run(args: argparse.Namespace, model: str, docs, questions, workdir: Path, redis_url: str | None) -> dict:
    engines = Engines(args, model, workdir, redis_url)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rounds: dict[str, list[dict]] = {name: [] for name in engines.engines}
    try:
        for index, round_name in enumerate(ROUNDS):
            if index == 1 and args.second_instance:
                engines.add_second_instances()
                rounds.update({name: [{}] for name in engines.engines if name not in rounds})
            if index and args.drop_page_cache and "disk" in args.tiers:
                drop_page_cache(workdir / "disk")
            records = {name: {"round": round_name, "before": numeric_stats(llm.engine), "ttft_ms": []}
                       for name, llm in engines.engines.items()}
            for n, prompt in enumerate(round_prompts(docs, questions, index)):
                for name, llm in engines.engines.items():
                    out = serve(llm.engine, [prompt], params, 1, tag=f"r{index}-{n}")[0]
                    records[name]["ttft_ms"].append(1000 * out.metrics.time_to_first_token)
            for name, llm in engines.engines.items():
                record = records[name]
                record["hits"] = hit_tokens(delta(record.pop("before"), numeric_stats(llm.engine)))
                record["ttft_p50_ms"] = percentile(record["ttft_ms"], 50)
                rounds[name].append(record)
            for llm in engines.engines.values():
                with contextlib.suppress(AttributeError):
                    llm.engine.connector.store.drain(60)
    finally:
        engines.close()
    return rounds


# ---- main and report -------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    model, _ = checkpoint(args)
    probe = LLM(model=model, dtype=args.dtype, num_kv_blocks=16, **smoke_engine_options(args))
    docs, questions = make_documents(probe, args)
    kv_bytes_per_token = probe.engine.block_bytes // 16
    probe.close()
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": model, "kv_bytes_per_token": kv_bytes_per_token,
              "modules": list(MODULES[: args.num_docs])}
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    try:
        with local_redis(args.redis_url if "redis" in args.tiers else "unused") as redis_url:
            if "redis" in args.tiers:
                flush_redis(redis_url)
            result["rounds"] = run(args, model, docs, questions, workdir, redis_url)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result["ratios"] = ratios(result["rounds"])
    plot(result)
    publish(NAME, result, render(result))
    return 0


def ratios(rounds: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Per engine and round (after the first), the median over requests of its TTFT over
    the reference's TTFT for the same request."""
    reference = rounds[REFERENCE]
    out: dict[str, dict[str, float]] = {}
    for name, records in rounds.items():
        if name == REFERENCE:
            continue
        for record, ref in zip(records, reference, strict=True):
            if record.get("ttft_ms") and record["round"] != "first":
                pairs = [m / r for m, r in zip(record["ttft_ms"], ref["ttft_ms"], strict=True)]
                out.setdefault(name, {})[record["round"]] = median(pairs)
    return out


def target_of(name: str, round_name: str) -> float | None:
    return TARGETS.get(round_name, {}).get(name.split(",")[0])


def render(result: dict) -> str:
    args, rounds = result["args"], result["rounds"]
    text = (f"Store hits: {args['num_docs']} documents of {args['doc_tokens']} tokens of pydoc text, device pool "
            f"{args['pool_fraction']:.0%} of them (the reference holds all), {args['dtype']}, "
            f"{args['chunk_tokens']}-token records; one request at a time, every engine in turn\n\n")
    rows = []
    for name, records in rounds.items():
        for record in records:
            if not record.get("ttft_ms"):
                continue
            ratio = result["ratios"].get(name, {}).get(record["round"])
            target = target_of(name, record["round"])
            hits = record["hits"]
            rows.append([name, record["round"], record["ttft_p50_ms"],
                         "" if ratio is None else f"{ratio:.2f}", "" if target is None else f"<= {target}",
                         "" if ratio is None or target is None else ("met" if ratio <= target else "missed"),
                         hits["device"], hits["cpu"], hits["disk"], hits["redis"]])
    return text + markdown_table(["engine", "round", "TTFT p50 ms", "TTFT / device-hit TTFT", "target", "",
                                  "device tok", "cpu tok", "disk tok", "redis tok"], rows)


def plot(result: dict) -> None:
    rounds = [r for r in ROUNDS if r != "first"]
    names = list(result["ratios"])
    series = {r: [result["ratios"][n].get(r, float("nan")) for n in names] for r in rounds}
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("TTFT / device-hit TTFT (paired median)", "engine", "x the device hit", names, series,
                    kind="bar", hlines={"1": 1.0}),
    ], "Store hits against device hits")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    args, ratios_ = result["args"], result["ratios"]
    reference = result["rounds"][REFERENCE]
    text = (f"The {args['num_docs']} documents are real text ({', '.join(result['modules'])}); each comes back "
            "after the others have evicted it from the store engines' device pools. The reference engine's TTFT "
            f"(device hit) was {reference[1]['ttft_p50_ms']:.0f} ms on a replay and "
            f"{reference[2]['ttft_p50_ms']:.0f} ms with a new question (p50). ")
    verdicts = []
    for name, by_round in ratios_.items():
        for round_name, ratio in by_round.items():
            target = target_of(name, round_name)
            mark = "" if target is None else (" (met)" if ratio <= target else f" (missed, target {target})")
            verdicts.append(f"{name} {round_name} {ratio:.2f}x{mark}")
    return (text + "Store hit over device hit, per request (median): " + "; ".join(verdicts) + ".").strip()
