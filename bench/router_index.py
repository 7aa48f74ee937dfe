"""The router's own cost at fleet scale, in process (issue 46's targets): synthetic KV event
streams of many instances holding a million blocks between them, decoded and applied to
the router's FleetIndex as its event threads do (msgpack batches as the instances send
them, no sockets), then a long request scored against every instance (the lookup the kv
policy runs per request) and its prompt named (the block hash chain the router computes).

Targets: ingestion >= 100k blocks/s; scoring an 8,000-token request <= 1 ms.
"""

from __future__ import annotations

import argparse
import random
import time

from bench import plots
from bench.common import markdown_table, median, parse_with_smoke, percentile
from bench.summary import publish, run_stamp
from engine.hashing import BlockHasher
from engine.kv_events.schema import BlockStored, KVEventBatch, decoder, encoder, external_hash
from engine.router.fleet_index import FleetIndex

NAME = "router-index"
MEDIUMS = ("GPU", "CPU", "DISK", "SHARED:REDIS")
BLOCK_SIZE = 16
EVENT_BLOCKS = 32  # blocks per BlockStored: a 512-token prompt's run
BATCH_EVENTS = 16  # events per batch

SMOKE = {"instances": 4, "blocks": 20_000, "prompt_tokens": 2000, "repeats": 20}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--blocks", type=int, default=1_000_000, help="Blocks held by all instances together.")
    p.add_argument("--prompt-tokens", type=int, default=8000, help="The scored request's length.")
    p.add_argument("--repeats", type=int, default=200, help="Scorings timed.")
    p.add_argument("--seed", type=int, default=0)
    return parse_with_smoke(p, argv, SMOKE)


def event_streams(args: argparse.Namespace, rng: random.Random) -> dict[str, list[bytes]]:
    """Per instance, its encoded batches: random block runs in random mediums."""
    pack = encoder()
    streams: dict[str, list[bytes]] = {}
    per_instance = args.blocks // args.instances
    for i in range(args.instances):
        events = [BlockStored([rng.getrandbits(64) for _ in range(EVENT_BLOCKS)], None, [], BLOCK_SIZE, None,
                              rng.choice(MEDIUMS)) for _ in range(per_instance // EVENT_BLOCKS)]
        streams[f"http://10.0.{i // 256}.{i % 256}:8000"] = [
            pack.encode(KVEventBatch(time.time(), events[j:j + BATCH_EVENTS], 0))
            for j in range(0, len(events), BATCH_EVENTS)]
    return streams


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    rng = random.Random(args.seed)
    streams = event_streams(args, rng)
    index = FleetIndex()
    for url in streams:
        index.join(url, "shared-redis")
    decode = decoder()
    blocks = 0
    start = time.perf_counter()
    for url, batches in streams.items():  # as one event thread per instance would, one after another
        for payload in batches:
            batch = decode.decode(payload)
            blocks += sum(len(e.block_hashes) for e in batch.events)
            index.apply(url, batch.events)
    ingest_s = time.perf_counter() - start

    # the request: its first half held by one instance on the device, a quarter more in its cpu tier
    hasher = BlockHasher(bytes(32), BLOCK_SIZE)
    tokens = [rng.randrange(32000) for _ in range(args.prompt_tokens)]
    prompt_hashes = hasher.hashes(tokens)
    prompt = [external_hash(h) for h in prompt_hashes]
    holder = next(iter(streams))
    half, quarter = len(prompt) // 2, len(prompt) // 4
    index.apply(holder, [BlockStored(prompt[:half], None, [], BLOCK_SIZE, None, "GPU"),
                         BlockStored(prompt[half:half + quarter], None, [], BLOCK_SIZE, None, "CPU")])
    urls = list(streams)
    score_ms, hash_ms = [], []
    for _ in range(args.repeats):
        start = time.perf_counter()
        holdings = index.holdings(urls, prompt)
        score_ms.append((time.perf_counter() - start) * 1e3)
        start = time.perf_counter()
        hasher.hashes(tokens)
        hash_ms.append((time.perf_counter() - start) * 1e3)
    assert holdings[holder].device == half and holdings[holder].loadable == {"cpu": quarter}
    summary = {
        "blocks": blocks, "ingest_s": ingest_s, "ingest_blocks_per_s": blocks / ingest_s,
        "score_ms_p50": median(score_ms), "score_ms_p99": percentile(score_ms, 99),
        "hash_ms_p50": median(hash_ms), "hash_ms_p99": percentile(hash_ms, 99),
    }
    result = {**run_stamp(NAME, argv), "args": vars(args), "summary": summary,
              "samples": {"score_ms": score_ms, "hash_ms": hash_ms}}
    plot(result)
    publish(NAME, result, render(result))
    return 0


def render(result: dict) -> str:
    s, a = result["summary"], result["args"]
    rows = [
        ["event ingestion (decode + apply)", f"{s['ingest_blocks_per_s']:.0f} blocks/s", ">= 100000 blocks/s"],
        [f"scoring a {a['prompt_tokens']}-token request, p50", f"{s['score_ms_p50']:.3f} ms", "<= 1 ms"],
        [f"scoring a {a['prompt_tokens']}-token request, p99", f"{s['score_ms_p99']:.3f} ms", ""],
        ["naming it (block hash chain), p50", f"{s['hash_ms_p50']:.3f} ms", ""],
    ]
    return (f"The router's index at scale: {a['instances']} instances holding {s['blocks']} blocks, "
            f"load average {result['load_average_start'][0]:.1f} at start\n\n"
            + markdown_table(["what", "measured", "target"], rows))


def plot(result: dict) -> None:
    samples = result["samples"]
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("per request", "what", "ms (median)", ["score", "hash"],
                    {"median": [median(samples["score_ms"]), median(samples["hash_ms"])]}, kind="bar",
                    hlines={"score target": 1.0}),
    ], "Router index: the cost of one routing decision")


def describe(result: dict) -> str:
    s, a = result["summary"], result["args"]
    return (f"With {a['instances']} instances holding {s['blocks']} blocks, the router's index took events in at "
            f"{s['ingest_blocks_per_s'] / 1e3:.0f}k blocks/s (msgpack decode and apply; target 100k) and scored "
            f"a {a['prompt_tokens']}-token request against every instance in {s['score_ms_p50']:.2f} ms at the "
            f"median (target 1 ms); naming its blocks (SHA-256 chain) took {s['hash_ms_p50']:.2f} ms more.")
