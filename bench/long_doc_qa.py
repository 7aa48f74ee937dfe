"""Long-document QA replay: what the KV store buys when long contexts come back after the
device cache has evicted them.

N documents of D tokens with no shared prefix, together about 2.3x the device KV pool,
each followed by a short question; three rounds: in order, the same order again,
reverse order. By default every round replays the same prompts (LMCache's shape);
`--questions new` asks a new question per round, so the prompt's last chunk differs
from the one stored and the store can supply only the document's full chunks. Store
configurations: no offload, cpu, disk (page cache dropped before each round), cpu+disk,
redis. Reported per round: TTFT p50/p99 and the prompt
tokens each source served (device prefix cache, cpu, disk, redis).

One request at a time, every configuration has its own engine and the engines serve
each request in turn, together with a reference engine whose pool holds every document
(its TTFT from round 2 on is a device prefix hit: only the last partial block, or what
follows the document, is computed). So every TTFT is paired with the others' for the
same request a moment apart, and the ratios hold on a machine whose speed drifts. Then
with 4 in flight, one configuration after the other.

Physical floor of a tier for a request: its device-hit TTFT plus the bytes it loaded
from the tier divided by the tier's raw read bandwidth, measured in the same run
(memcpy for cpu, parallel cold file reads for disk, for redis the faster of redis-py's
pipelined GETs and the store's own `recv_into` reader).
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from bench import plots
from bench.common import (
    add_dtype_arg,
    markdown_table,
    parse_with_smoke,
    percentile,
    smoke_engine_options,
)
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
from bench.summary import publish, run_stamp
from bench.text_corpus import CorpusTokens, passage_tokens, token_documents
from engine import LLM, SamplingParams
from engine.builtin_models import resolve_model

ROUND_ORDERS = ("in order", "same order", "reverse")
REFERENCE = "device-hit"  # the engine whose pool holds every document
WARM_UP_TOKENS = 512
MEMCPY_BYTES = 64 << 20


SMOKE = {"num_docs": 3, "doc_tokens": 192, "question_tokens": 4, "max_tokens": 2, "chunk_tokens": 64,
         "concurrency": [1, 2], "configs": ["none", "cpu", "disk"]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench long-doc-qa", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint directory (default: the built-in model).")
    add_dtype_arg(p)
    p.add_argument("--num-docs", type=int, default=10)
    p.add_argument("--doc-tokens", type=int, default=5000)
    p.add_argument("--question-tokens", type=int, default=16)
    p.add_argument("--questions", choices=("same", "new"), default="same",
                   help="Replay each document's question every round, or ask a new one per round.")
    p.add_argument("--max-tokens", type=int, default=8, help="Answer length.")
    p.add_argument("--capacity-ratio", type=float, default=2.3,
                   help="Total document tokens / device KV pool tokens.")
    p.add_argument("--concurrency", type=int, nargs="+", default=(1, 4),
                   help="1 runs the paired one-at-a-time replay; larger values run each store in turn.")
    p.add_argument("--configs", nargs="+", default=("none", "cpu", "disk", "cpu+disk", "redis"),
                   choices=sorted(STORE_CONFIGS))
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--redis-url", default=None,
                   help="Without a database number (each store gets its own). Default: a private "
                        "redis-server on loopback.")
    p.add_argument("--seed", type=int, default=0)
    return parse_with_smoke(p, argv, SMOKE)


# ---- workload ------------------------------------------------------------------------------


def make_docs(args: argparse.Namespace, tokenizer: Any) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Documents of real text (disjoint runs of the corpus), and per round one question
    per document (another run of it)."""
    rng, corpus = random.Random(args.seed), CorpusTokens(tokenizer)
    docs = token_documents(tokenizer, [args.doc_tokens] * args.num_docs, seed=args.seed)
    questions = [[corpus.take(rng, args.question_tokens) for _ in docs] for _ in ROUND_ORDERS]
    if args.questions == "same":
        questions = [questions[0]] * len(ROUND_ORDERS)
    return docs, questions


def round_prompts(docs, questions, round_index: int) -> list[list[int]]:
    order = list(range(len(docs)))
    if ROUND_ORDERS[round_index] == "reverse":
        order.reverse()
    return [docs[i] + questions[round_index][i] for i in order]


def engine_options(args: argparse.Namespace, concurrency: int) -> dict:
    per_request = args.doc_tokens + args.question_tokens + args.max_tokens
    pool_tokens = max(args.num_docs * args.doc_tokens / args.capacity_ratio, concurrency * per_request)
    return {"dtype": args.dtype, "num_kv_blocks": math.ceil(pool_tokens / 16), "block_size": 16,
            "max_num_seqs": concurrency, "kv_chunk_tokens": args.chunk_tokens,
            "max_num_batched_tokens": args.max_num_batched_tokens, **smoke_engine_options(args)}


def reference_options(args: argparse.Namespace) -> dict:
    options = engine_options(args, 1)
    per_request = args.doc_tokens + args.question_tokens + args.max_tokens
    options["num_kv_blocks"] = math.ceil(args.num_docs * per_request * 1.1 / 16) + 64
    return options


def redis_urls(configs, redis_url: str | None) -> dict[str, str | None]:
    """One Redis database per configuration that uses Redis, so they never share."""
    users = [c for c in configs if "redis" in STORE_CONFIGS[c]]
    return {c: (f"{redis_url}/{users.index(c)}" if c in users else None) for c in configs}


def warm_up(llm: LLM, seed: int, tokens: int = WARM_UP_TOKENS) -> None:
    """One untimed request first: the first forward of an engine pays one-off costs."""
    prompt = passage_tokens(llm.engine.tokenizer, tokens, seed=-seed - 1)
    serve(llm.engine, [prompt], SamplingParams(max_tokens=2, temperature=0.0), 1, tag="warm-up")


# ---- runs ----------------------------------------------------------------------------------


def run_paired(args, model: str, docs, questions, redis_url: str | None) -> dict:
    """One request at a time; per request, every engine in turn."""
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    urls = redis_urls(args.configs, redis_url)
    engines = {REFERENCE: LLM(model=model, **reference_options(args))}
    try:
        for config in args.configs:
            options = store_options(config, workdir / config, urls[config])
            engines[config] = LLM(model=model, **engine_options(args, 1), **options)
        for llm in engines.values():
            warm_up(llm, args.num_docs, min(WARM_UP_TOKENS, args.doc_tokens))
        rounds = {name: [] for name in engines}
        for index in range(len(ROUND_ORDERS)):
            for name, llm in engines.items():
                rounds[name].append(_start_round(name, llm, workdir))
            for n, prompt in enumerate(round_prompts(docs, questions, index)):
                for name, llm in engines.items():
                    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
                    out = serve(llm.engine, [prompt], params, 1, tag=f"r{index}-{n}")[0]
                    rounds[name][-1]["ttft_ms"].append(1000 * out.metrics.time_to_first_token)
            for name, llm in engines.items():
                _finish_round(rounds[name][-1], llm, index)
        bandwidth = {c: tier_bandwidths(c, workdir / c, urls[c]) for c in args.configs}
    finally:
        for llm in engines.values():
            llm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"rounds": rounds, "bandwidth_gb_s": bandwidth}


def _start_round(name: str, llm: LLM, workdir: Path) -> dict:
    if name in STORE_CONFIGS and "disk" in STORE_CONFIGS[name]:
        drop_page_cache(workdir / name / "disk")
    return {"before": numeric_stats(llm.engine), "ttft_ms": []}


def _finish_round(record: dict, llm: LLM, index: int) -> None:
    stats = delta(record.pop("before"), numeric_stats(llm.engine))
    ttfts = record["ttft_ms"]
    record.update(round=index + 1, order=ROUND_ORDERS[index], ttft_p50_ms=percentile(ttfts, 50),
                  ttft_p99_ms=percentile(ttfts, 99), hits=hit_tokens(stats))


def run_concurrent(args, model: str, config: str, concurrency: int, docs, questions, redis_url) -> dict:
    """`concurrency` requests in flight; one configuration alone."""
    workdir = Path(tempfile.mkdtemp(prefix="kvtier-bench-"))
    url = redis_urls([config], redis_url)[config]
    if url:
        flush_redis(redis_url)
    llm = LLM(model=model, **engine_options(args, concurrency), **store_options(config, workdir, url))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rounds = []
    try:
        warm_up(llm, args.num_docs, min(WARM_UP_TOKENS, args.doc_tokens))
        for index in range(len(ROUND_ORDERS)):
            if "disk" in STORE_CONFIGS[config]:
                drop_page_cache(workdir / "disk")
            record = {"before": numeric_stats(llm.engine), "ttft_ms": []}
            outputs = serve(llm.engine, round_prompts(docs, questions, index), params, concurrency, f"r{index}")
            record["ttft_ms"] = [1000 * o.metrics.time_to_first_token for o in outputs]
            _finish_round(record, llm, index)
            rounds.append(record)
    finally:
        llm.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return {"rounds": rounds}


# ---- raw bandwidth of the tiers ------------------------------------------------------------


def tier_bandwidths(config: str, workdir: Path, redis_url: str | None) -> dict[str, float]:
    """Raw read bandwidth (GB/s) of each tier of the configuration, on its own records."""
    tiers = STORE_CONFIGS[config].split(",") if STORE_CONFIGS[config] else []
    out = {}
    if "cpu" in tiers:
        out["cpu"] = memcpy_bandwidth(MEMCPY_BYTES)
    if "disk" in tiers:
        out["disk"] = cold_read_bandwidth(workdir / "disk")
    if "redis" in tiers:
        out["redis"] = redis_get_bandwidth(redis_url)
    return out


def memcpy_bandwidth(nbytes: int, repeats: int = 10) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros_like(src)
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
    """The faster of two raw reads of every record: redis-py's pipelined GETs on one
    connection, and the store's own reader (GETRANGE pipelines received with
    `recv_into` into preallocated buffers, over as many connections as the read pool)."""
    import redis

    from kvstore.loading import READ_THREADS
    from tiers.redis_url import parse_redis_url
    from tiers.resp import BulkReader

    client = redis.Redis.from_url(url)
    keys = list(client.scan_iter(count=1000))
    if not keys:
        return float("nan")
    buffers = [memoryview(bytearray(client.strlen(key))) for key in keys]
    nbytes = sum(b.nbytes for b in buffers)

    def pipelined_gets() -> None:
        for i in range(0, len(keys), batch):
            pipe = client.pipeline(transaction=False)
            for key in keys[i : i + batch]:
                pipe.get(key)
            pipe.execute()

    reader = BulkReader(parse_redis_url(url), timeout_s=60, connect_timeout_s=10)
    size = -(-len(keys) // READ_THREADS)
    parts = [([k.decode() for k in keys[i : i + size]], buffers[i : i + size]) for i in range(0, len(keys), size)]

    def received_in_place() -> None:
        with ThreadPoolExecutor(len(parts)) as pool:
            list(pool.map(lambda part: reader.get_into(*part), parts))

    # best of three each: later passes read into buffers already faulted in, as the slots are
    return nbytes / min(_timed(read) for read in (pipelined_gets, received_in_place) for _ in range(3)) / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


# ---- main and report -----------------------------------------------------------------------

NAME = "long-doc-qa"  # bench/results/NAME.json, .md, .png
FLOOR_TARGET, SPEEDUP_TARGET = 1.5, 10  # TTFT / floor at most; no-offload TTFT / cpu TTFT in round 2 at least
REDIS_LOAD_TARGET = 1.2  # (redis TTFT - device-hit TTFT) / raw transfer time, at most


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv or [])
    model = resolve_model(args.model)
    probe = LLM(model=model, dtype=args.dtype, num_kv_blocks=16, **smoke_engine_options(args))
    block_bytes = probe.engine.block_bytes
    docs, questions = make_docs(args, probe.engine.tokenizer)
    probe.close()
    result = {**run_stamp(NAME, argv or []), "args": vars(args), "model": model,
              "kv_bytes_per_token": block_bytes // 16, "concurrent": {}}
    needs_redis = any("redis" in STORE_CONFIGS[c] for c in args.configs)
    with local_redis(args.redis_url if needs_redis else "unused") as redis_url:
        if needs_redis:
            flush_redis(redis_url)
        if 1 in args.concurrency:
            result["paired"] = run_paired(args, model, docs, questions, redis_url)
            print(render_paired(result), flush=True)
        for concurrency in (c for c in args.concurrency if c > 1):
            for config in args.configs:
                run = run_concurrent(args, model, config, concurrency, docs, questions, redis_url)
                result["concurrent"][f"{config}@{concurrency}"] = run
                print(f"{config} x{concurrency}: " + ", ".join(
                    f"r{r['round']} p50 {r['ttft_p50_ms']:.0f} ms" for r in run["rounds"]), flush=True)
    plot(result)
    publish(NAME, result, render(result))
    return 0


def render(result: dict) -> str:
    args = result["args"]
    text = (f"Long-document QA replay: {args['num_docs']} docs x {args['doc_tokens']} tokens "
            f"(+{args['question_tokens']}-token question, {args['max_tokens']}-token answer), device pool = "
            f"total / {args['capacity_ratio']}, {args['dtype']}, {args['chunk_tokens']}-token chunks\n\n")
    if "paired" in result:
        text += render_paired(result) + "\n"
    if result["concurrent"]:
        text += "With requests in flight (one store after the other)\n\n"
        text += round_table({name: run["rounds"] for name, run in result["concurrent"].items()})
    return text


def render_paired(result: dict) -> str:
    rounds = result["paired"]["rounds"]
    return ("One request at a time (every store serves each request in turn; `device-hit` holds "
            "every document)\n\n" + round_table(rounds) + "\n" + target_table(result))


def round_table(runs: dict[str, list[dict]]) -> str:
    rows = []
    for name, rounds in runs.items():
        for rnd in rounds:
            hits = rnd["hits"]
            rows.append([name, f"{rnd['round']} ({rnd['order']})", rnd["ttft_p50_ms"], rnd["ttft_p99_ms"],
                         hits["device"], hits["cpu"], hits["disk"], hits["redis"]])
    return markdown_table(["store", "round", "TTFT p50 ms", "TTFT p99 ms", "device hit tok", "cpu tok",
                           "disk tok", "redis tok"], rows)


def floor_rows(result: dict) -> list[dict]:
    """Rounds 2 and 3 of every store that loaded something, per request then median:
    speedup over no offload, TTFT over the floor of the tier that served most (device-hit
    TTFT of the same request + loaded bytes / the tier's raw bandwidth), and over the
    round, the time the loads added (TTFT minus the device hit's) over the raw transfer
    time of what they loaded."""
    paired, args = result["paired"], result["args"]
    rounds = paired["rounds"]
    rows = []
    for config, bandwidth in paired["bandwidth_gb_s"].items():
        for index in (1, 2):
            rnd = rounds[config][index]
            loaded = {t: n for t, n in rnd["hits"].items() if t != "device" and n}
            if not loaded:
                continue
            tier = max(loaded, key=loaded.get)
            transfer_ms = 1000 * sum(loaded.values()) / args["num_docs"] * result["kv_bytes_per_token"] / (
                bandwidth[tier] * 1e9)
            mine, ref = rnd["ttft_ms"], rounds[REFERENCE][index]["ttft_ms"]
            base = rounds["none"][index]["ttft_ms"] if "none" in rounds else [float("nan")] * len(mine)
            rows.append({"store": config, "round": rnd["round"], "tier": tier, "gb_s": bandwidth[tier],
                         "ttft_p50_ms": rnd["ttft_p50_ms"], "device_hit_p50_ms": rounds[REFERENCE][index]["ttft_p50_ms"],
                         "transfer_ms": transfer_ms,
                         "over_floor": statistics.median(m / (r + transfer_ms) for m, r in zip(mine, ref, strict=True)),
                         "speedup": statistics.median(b / m for b, m in zip(base, mine, strict=True)),
                         # a round may mix device hits and loads: time added over transfer time, both summed
                         "load_over_transfer": (sum(mine) - sum(ref)) / (transfer_ms * len(mine))})
    return rows


def target_table(result: dict) -> str:
    return (f"Per request (median of the paired ratios): TTFT / floor (target <= {FLOOR_TARGET}), no-offload TTFT / "
            f"TTFT (target >= {SPEEDUP_TARGET} for cpu in round 2)\n\n" + markdown_table(
                ["store", "round", "main tier", "raw GB/s", "TTFT p50 ms", "device-hit p50 ms",
                 "transfer ms", "TTFT / floor", "speedup vs none", "load / transfer"],
                [list(row.values()) for row in floor_rows(result)]))


def ttft_p50s(runs: dict[str, list[dict]]) -> dict[str, list[float]]:
    return {name: [rnd["ttft_p50_ms"] for rnd in rounds] for name, rounds in runs.items()}


def plot(result: dict) -> None:
    axis = "round (" + ", ".join(f"{i} {order}" for i, order in enumerate(ROUND_ORDERS, 1)) + ")"
    x = list(range(1, len(ROUND_ORDERS) + 1))
    panels = []
    if "paired" in result:
        panels.append(plots.Panel("TTFT p50, one request at a time", axis, "ms", x,
                                  ttft_p50s(result["paired"]["rounds"]), logy=True))
    if result["concurrent"]:
        runs = {name: run["rounds"] for name, run in result["concurrent"].items()}
        panels.append(plots.Panel("TTFT p50, requests in flight", axis, "ms", x, ttft_p50s(runs), logy=True))
    rows = floor_rows(result) if "paired" in result else []
    if rows:
        stores = list(dict.fromkeys(row["store"] for row in rows))
        ratios = {(row["store"], row["round"]): row["over_floor"] for row in rows}
        series = {f"round {k}": [ratios.get((store, k), float("nan")) for store in stores] for k in (2, 3)}
        panels.append(plots.Panel("TTFT / floor (paired median)", "store", "x the floor", stores, series,
                                  kind="bar", hlines={f"target {FLOOR_TARGET}": FLOOR_TARGET}))
    plots.save_figure(plots.png_path(NAME), panels, "Long-document QA: TTFT per round and store")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    args = result["args"]
    text = (f"The {args['num_docs']} documents ({args['num_docs'] * args['doc_tokens']} tokens) are "
            f"{args['capacity_ratio']}x the device pool, and each comes back only after all the others, when the "
            "LRU pool has evicted it: round 1 computes every document, round 2 finds them in the store if there "
            "is one. ")
    if "paired" in result:
        text += _describe_paired(result)
    levels = {}
    for name, run in result["concurrent"].items():
        config, concurrency = name.rsplit("@", 1)
        levels.setdefault(concurrency, []).append(
            f"{config} " + "/".join(f"{rnd['ttft_p50_ms']:.0f}" for rnd in run["rounds"]) + " ms")
    for concurrency, stores in levels.items():
        text += (f"With {concurrency} in flight (one store after the other), TTFT p50 in rounds "
                 + "/".join(str(i) for i in range(1, len(ROUND_ORDERS) + 1)) + ": " + "; ".join(stores) + ". ")
    return text.strip()


def _describe_paired(result: dict) -> str:
    rounds = result["paired"]["rounds"]
    stores = [name for name in rounds if name not in (REFERENCE, "none")]
    text = (f"One request at a time, round 2 TTFT p50 is {rounds[REFERENCE][1]['ttft_p50_ms']:.0f} ms on the "
            "reference engine, whose pool holds every document (a device hit: only the prompt's tail is computed)")
    if "none" in rounds:
        text += (f", {rounds['none'][1]['ttft_p50_ms']:.0f} ms without offload (recomputed; "
                 f"{rounds['none'][0]['ttft_p50_ms']:.0f} ms in round 1)")
    text += "".join(f", {rounds[s][1]['ttft_p50_ms']:.0f} ms with {s}" for s in stores) + ". "
    if stores:
        device = rounds[stores[0]][2]["hits"]["device"]
        text += (f"In reverse order (round 3) the documents served last are still on the device ({device} tokens "
                 "from the device cache) and the others come from the store. ")
    rows = [row for row in floor_rows(result) if row["round"] == 2]
    if not rows:
        return text
    rest = {row["store"]: row["ttft_p50_ms"] - row["device_hit_p50_ms"] - row["transfer_ms"] for row in rows}
    text += ("Where the time goes, at p50 in round 2: TTFT = the reference engine's TTFT for the same request "
             "(the compute that is left) + moving the KV at the tier's raw bandwidth + the rest (lookup, staging "
             "copies, handing the load to the scheduler): " + "; ".join(
                 f"{row['store']} {row['ttft_p50_ms']:.0f} = {row['device_hit_p50_ms']:.0f} + "
                 f"{row['transfer_ms']:.1f} + {rest[row['store']]:.0f} ms" if rest[row["store"]] >= 0 else
                 f"{row['store']} {row['ttft_p50_ms']:.0f} ms, under the reference's {row['device_hit_p50_ms']:.0f} ms "
                 "(timing noise larger than the load)" for row in rows) + ". ")
    if len(rest) > 1 and min(rest.values()) > 0 and max(rest.values()) < 1.25 * min(rest.values()):
        text += (f"The rest is about the same whichever tier served the KV ({min(rest.values()):.0f}-"
                 f"{max(rest.values()):.0f} ms), so it is per-request work of the load path, not the tier's reads. ")
    text += "Per request, TTFT / floor and speedup over no offload (paired medians): " + "; ".join(
        f"{row['store']} {row['over_floor']:.1f}x and {row['speedup']:.1f}x" for row in rows) + ". "
    met = [row["store"] for row in rows if row["over_floor"] <= FLOOR_TARGET]
    missed = [row["store"] for row in rows if row["over_floor"] > FLOOR_TARGET]
    text += (f"Target TTFT / floor <= {FLOOR_TARGET} in round 2: "
             + ", ".join(f"{verb} by {', '.join(stores)}" for verb, stores in (("met", met), ("missed", missed)) if stores)
             + ". ")
    redis = [row for row in rows if row["store"] == "redis"]
    if redis:
        load = redis[0]["load_over_transfer"]
        text += (f"What Redis hits add to device hits, over the raw transfer of the same bytes (round 2, summed): "
                 f"{load:.2f}x (target <= {REDIS_LOAD_TARGET}: {'met' if load <= REDIS_LOAD_TARGET else 'missed'}). ")
    cpu = [row for row in rows if row["store"] == "cpu"]
    if cpu:
        text += (f"Target speedup >= {SPEEDUP_TARGET} for cpu in round 2: {cpu[0]['speedup']:.1f}x, "
                 f"{'met' if cpu[0]['speedup'] >= SPEEDUP_TARGET else 'missed'}. ")
    return text
