"""Long-document QA replay: what the KV store buys when long contexts come back after the
device cache has evicted them.

N documents of D tokens with no shared prefix, together about 2.3x the device KV pool,
each asked a short new question per round; three rounds: in order, the same order
again, reverse order; one request at a time, then with 4 in flight. For every store
configuration (no offload, cpu, disk with the page cache dropped before each round,
cpu+disk, redis) it reports TTFT p50/p99 per round and the prompt tokens each source
served (device prefix cache, cpu, disk, redis).

Physical floor of a tier (one request at a time): the TTFT of the same request when
its whole document is a device prefix hit (one step computing only the question) plus
the bytes loaded from the tier divided by the tier's raw read bandwidth, measured in
the same run (memcpy for cpu, parallel cold file reads for disk, pipelined GETs for
redis).
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import machine_info, markdown_table, median, percentile, write_result
from bench.kv_common import (
    STORE_CONFIGS,
    delta,
    drop_page_cache,
    flush_redis,
    hit_tokens,
    local_redis,
    numeric_stats,
    serve,
    store_options,
)
from engine import LLM, SamplingParams
from engine.builtin_model import default_model_path

ROUND_ORDERS = ("in order", "same order", "reverse")
WARM_UP_TOKENS = 512
FLOOR_REPEATS = 3  # device-hit TTFT: the least of this many tries per document


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench long-doc-qa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint directory (default: the built-in model).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-docs", type=int, default=10)
    p.add_argument("--doc-tokens", type=int, default=5000)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8, help="Answer length.")
    p.add_argument("--capacity-ratio", type=float, default=2.3,
                   help="Total document tokens / device KV pool tokens.")
    p.add_argument("--concurrency", type=int, nargs="+", default=(1, 4))
    p.add_argument("--configs", nargs="+", default=("none", "cpu", "disk", "cpu+disk", "redis"),
                   choices=sorted(STORE_CONFIGS))
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--redis-url", default=None, help="Default: a private redis-server on loopback.")
    p.add_argument("--floor-docs", type=int, default=3, help="Documents timed for the device-hit step.")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_docs(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Documents, and per round one question per document."""
    rng = random.Random(args.seed)
    docs = [[rng.randrange(3, vocab) for _ in range(args.doc_tokens)] for _ in range(args.num_docs)]
    questions = [[[rng.randrange(3, vocab) for _ in range(args.question_tokens)] for _ in docs]
                 for _ in ROUND_ORDERS]
    return docs, questions


def round_order(round_index: int, num_docs: int) -> list[int]:
    order = list(range(num_docs))
    return order[::-1] if ROUND_ORDERS[round_index] == "reverse" else order


def engine_options(args: argparse.Namespace, concurrency: int) -> dict:
    per_request = args.doc_tokens + args.question_tokens + args.max_tokens
    pool_tokens = args.num_docs * args.doc_tokens / args.capacity_ratio
    return {"dtype": args.dtype, "num_kv_blocks": math.ceil(max(pool_tokens, concurrency * per_request) / 16),
            "block_size": 16, "max_num_seqs": concurrency, "kv_chunk_tokens": args.chunk_tokens,
            "max_num_batched_tokens": args.max_num_batched_tokens}


def run_config(args, model: str, config: str, concurrency: int, docs, questions, redis_url) -> dict:
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    if "redis" in STORE_CONFIGS[config]:
        flush_redis(redis_url)
    llm = LLM(model=model, **engine_options(args, concurrency), **store_options(config, workdir, redis_url))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rounds = []
    try:
        warm_up(llm, len(docs))
        for index, name in enumerate(ROUND_ORDERS):
            if "disk" in STORE_CONFIGS[config]:
                drop_page_cache(workdir / "disk")
            order = round_order(index, len(docs))
            prompts = [docs[i] + questions[index][i] for i in order]
            before = numeric_stats(llm.engine)
            outputs = serve(llm.engine, prompts, params, concurrency, tag=f"r{index}")
            stats = delta(before, numeric_stats(llm.engine))
            ttfts = [1000 * o.metrics.time_to_first_token for o in outputs]
            rounds.append({"round": index + 1, "order": name, "ttft_p50_ms": percentile(ttfts, 50),
                           "ttft_p99_ms": percentile(ttfts, 99), "hits": hit_tokens(stats),
                           "prompt_tokens": sum(map(len, prompts))})
        bandwidth = tier_bandwidths(config, workdir, redis_url, llm.engine.block_bytes)
    finally:
        llm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"rounds": rounds, "bandwidth_gb_s": bandwidth}


def device_hit_ttft_ms(args, model: str, docs, questions) -> float:
    """TTFT when the whole document is a device prefix hit (only the question is
    computed): the compute floor. Median over documents of the best of a few tries."""
    options = engine_options(args, 1)
    options["num_kv_blocks"] = math.ceil(args.floor_docs * (args.doc_tokens + 64) / 16) + 64
    llm = LLM(model=model, **options)
    warm_up(llm, args.floor_docs)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = random.Random(args.seed + 1)
    times = []
    for i in range(args.floor_docs):
        serve(llm.engine, [docs[i] + questions[0][i]], params, 1, tag=f"prefill{i}")
        repeats = []
        for j in range(FLOOR_REPEATS):
            question = [rng.randrange(3, llm.engine.spec.vocab_size) for _ in range(args.question_tokens)]
            out = serve(llm.engine, [docs[i] + question], params, 1, tag=f"hit{i}-{j}")[0]
            repeats.append(1000 * out.metrics.time_to_first_token)
        times.append(min(repeats))
    llm.close()
    return median(times)


def warm_up(llm: LLM, seed: int) -> None:
    """One untimed request first: the first forward of an engine pays one-off costs."""
    rng = random.Random(-seed - 1)
    prompt = [rng.randrange(3, llm.engine.spec.vocab_size) for _ in range(WARM_UP_TOKENS)]
    serve(llm.engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0), 1, tag="warm-up")


def tier_bandwidths(config: str, workdir: Path, redis_url: str | None, block_bytes: int) -> dict[str, float]:
    """Raw read bandwidth (GB/s) of each tier of the configuration, on its own records."""
    tiers = STORE_CONFIGS[config].split(",") if STORE_CONFIGS[config] else []
    out = {}
    if "cpu" in tiers:
        out["cpu"] = memcpy_bandwidth(256 * block_bytes)
    if "disk" in tiers:
        out["disk"] = cold_read_bandwidth(workdir / "disk")
    if "redis" in tiers:
        out["redis"] = redis_get_bandwidth(redis_url)
    return out


def memcpy_bandwidth(nbytes: int, repeats: int = 5) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return nbytes / best / 1e9


def cold_read_bandwidth(root: Path, workers: int = 8) -> float:
    drop_page_cache(root)
    files = [p for p in root.rglob("*") if p.is_file()]
    with ThreadPoolExecutor(workers) as pool:
        start = time.perf_counter()
        nbytes = sum(pool.map(lambda p: len(p.read_bytes()), files))
        seconds = time.perf_counter() - start
    return nbytes / seconds / 1e9 if nbytes else float("nan")


def redis_get_bandwidth(url: str, batch: int = 16) -> float:
    import redis

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(count=1000))
    start = time.perf_counter()
    nbytes = 0
    for i in range(0, len(keys), batch):
        pipe = client.pipeline(transaction=False)
        for key in keys[i : i + batch]:
            pipe.get(key)
        nbytes += sum(len(v or b"") for v in pipe.execute())
    seconds = time.perf_counter() - start
    return nbytes / seconds / 1e9 if nbytes else float("nan")


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    model = args.model or default_model_path()
    probe = LLM(model=model, dtype=args.dtype, num_kv_blocks=16)
    vocab, block_bytes = probe.engine.spec.vocab_size, probe.engine.block_bytes
    probe.close()
    docs, questions = make_docs(args, vocab)
    result = {"machine": machine_info(), "args": vars(args), "model": model,
              "kv_bytes_per_token": block_bytes // 16, "runs": {}}
    needs_redis = any("redis" in STORE_CONFIGS[c] for c in args.configs)
    with local_redis(args.redis_url if needs_redis else "unused") as redis_url:
        result["device_hit_ttft_ms"] = device_hit_ttft_ms(args, model, docs, questions)
        for config in args.configs:
            for concurrency in args.concurrency:
                run = run_config(args, model, config, concurrency, docs, questions, redis_url)
                result["runs"][f"{config}@{concurrency}"] = run
                print(f"{config} x{concurrency}: " + ", ".join(
                    f"r{r['round']} p50 {r['ttft_p50_ms']:.1f} ms" for r in run["rounds"]), flush=True)
    text = render(result)
    write_result("long_doc_qa", result, text)
    print(text)
    return 0


def floors(result: dict, run: dict, round_index: int = 1) -> dict[str, float]:
    """Physical floor (ms) per tier that served round `round_index` of a run."""
    step = result["device_hit_ttft_ms"]
    rnd = run["rounds"][round_index]
    num_requests = result["args"]["num_docs"]
    out = {}
    for tier, gb_s in run["bandwidth_gb_s"].items():
        tokens = rnd["hits"][tier] / num_requests
        if tokens:
            out[tier] = step + 1000 * tokens * result["kv_bytes_per_token"] / (gb_s * 1e9)
    return out


def render(result: dict) -> str:
    args = result["args"]
    text = (f"Long-document QA replay: {args['num_docs']} docs x {args['doc_tokens']} tokens "
            f"(+{args['question_tokens']}-token question), device pool = total / {args['capacity_ratio']}, "
            f"{args['dtype']}, chunk {args['chunk_tokens']} tokens\n\n"
            f"Device-hit TTFT (compute floor): {result['device_hit_ttft_ms']:.1f} ms\n\n")
    rows = []
    for name, run in result["runs"].items():
        config, concurrency = name.split("@")
        for rnd in run["rounds"]:
            hits = rnd["hits"]
            rows.append([config, concurrency, f"{rnd['round']} ({rnd['order']})", rnd["ttft_p50_ms"],
                         rnd["ttft_p99_ms"], hits["device"], hits["cpu"], hits["disk"], hits["redis"],
                         rnd["prompt_tokens"]])
    text += markdown_table(["store", "in flight", "round", "TTFT p50 ms", "TTFT p99 ms", "device hit tok",
                            "cpu tok", "disk tok", "redis tok", "prompt tok"], rows)
    text += "\n" + render_targets(result)
    return text


def render_targets(result: dict) -> str:
    rows = []
    runs = result["runs"]
    base = runs.get("none@1")
    for name, run in runs.items():
        if not name.endswith("@1") or name == "none@1":
            continue
        p50 = run["rounds"][1]["ttft_p50_ms"]
        speedup = base["rounds"][1]["ttft_p50_ms"] / p50 if base else float("nan")
        for tier, floor_ms in floors(result, run).items():
            rows.append([name.split("@")[0], tier, run["bandwidth_gb_s"][tier], p50, floor_ms,
                         p50 / floor_ms, speedup])
    return "Round 2, one request at a time: TTFT p50 against the physical floor\n\n" + markdown_table(
        ["store", "tier", "raw GB/s", "TTFT p50 ms", "floor ms", "p50 / floor (target <= 1.5)",
         "no-offload p50 / p50 (target >= 10)"], rows)
