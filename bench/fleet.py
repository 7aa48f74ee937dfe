"""A fleet behind `kvtier router`: two or more `kvtier serve` instances of the model (one
torch thread each, bound to a CPU of their own where there are enough), with and without a
shared Redis, and the routing policies compared in the same run.

Workloads, each request a streamed completion of token ids sent one after the other:
- multi-round QA (LMCache's shape): users, each with a document context of its own, ask
  several rounds of questions, interleaved (a random order of the users every round); a
  round's prompt is the user's previous prompt, an answer and a new question;
- shared documents: many users ask about the same few documents, in a random order.

Each policy runs the workloads under its own `cache_salt`, so no policy finds what another
left in the caches. Reported per policy and store: the share of the reusable prompt tokens
(those an earlier request of the run had as a prefix) served from the chosen instance's
device cache (its `vllm:prefix_cache_hits` counter) and from anywhere
(`usage.prompt_tokens_details.cached_tokens`), the router's predicted device tokens (its
/metrics), and the mean TTFT of the rounds after the first. Then the router's own cost:
the latency of one request of --latency-tokens, routed (policy kv over one instance, so
it tokenizes, hashes and scores) and direct to that instance, interleaved, and the
router's own time on those requests before sending them (its routing histogram, as bucket
bounds). With the shared Redis, prefill/decode disaggregation: the longest inter-token gap
of --streams running decodes while --long-prompts long prompts arrive, the same instances
colocated (round-robin) and disaggregated (the first prefills, the others decode). Last,
the router's hop: the same pairs, --hop-requests of them, against an instance of a tiny
random model, where their difference is the router's and not the instance's variation.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import plots
from bench.common import markdown_table, parse_with_smoke, percentile
from bench.kv_common import local_redis
from bench.server_process import ServerProcess
from bench.summary import checkpoint, publish, run_stamp, workload_parser
from bench.text_corpus import CorpusTokens
from engine.random_model import make_model

NAME = "fleet"
SERVED_NAME = "fleet"
ROUTER = (sys.executable, "-m", "engine.cli", "router")
EVENTS = json.dumps({"enable_kv_cache_events": True, "endpoint": "tcp://*:*", "replay_endpoint": "tcp://*:*"})
STORES = {"shared-redis": "cpu,redis", "cpu-only": "cpu"}
WORKLOADS = ("multi-round-qa", "shared-docs")
REQUEST_TIMEOUT_S = 900
BLOCK_SIZE = 16  # kvtier's default: only whole blocks are reused
HOP_TOKEN_IDS = range(10, 200)  # in the tiny model's vocabulary (router_hop)
HOP_TARGET_MS = (2.0, 10.0)  # issue 46: the router's added latency, p50 and p99

SMOKE = {"instances": 2, "users": 3, "doc_tokens": 96, "rounds": 2, "question_tokens": 8, "answer_tokens": 8,
         "docs": 2, "doc_users": 3, "max_tokens": 2, "latency_tokens": 128, "latency_requests": 3, "hop_requests": 3,
         "streams": 2, "stream_tokens": 24, "long_prompts": 2, "long_tokens": 128,
         "kv_pool": "64MiB", "cpu_tier": "32MiB", "chunk_tokens": 32,
         # the cpu-only fleet and the session policy run the same code paths
         "stores": ["shared-redis"], "policies": ["kv", "round-robin"]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "nothing (this workload takes no profile)")
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--policies", nargs="+", default=["kv", "round-robin", "session"],
                   choices=["kv", "round-robin", "least-load", "session"])
    p.add_argument("--stores", nargs="+", default=list(STORES), choices=list(STORES),
                   help="shared-redis: cpu and a shared Redis tier; cpu-only: no shared store.")
    p.add_argument("--users", type=int, default=7, help="Multi-round QA users (odd: round-robin then moves them).")
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--answer-tokens", type=int, default=48, help="The answer added to a user's context per round.")
    p.add_argument("--docs", type=int, default=3, help="Shared-document workload: the documents.")
    p.add_argument("--doc-users", type=int, default=12, help="Shared-document workload: questions (users).")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--latency-tokens", type=int, default=2000)
    p.add_argument("--latency-requests", type=int, default=40)
    p.add_argument("--hop-requests", type=int, default=200,
                   help="Pairs of the router's hop measured against a tiny-model instance.")
    p.add_argument("--kv-pool", default="2GiB", help="Device KV pool of each instance (the decode instance "
                   "of the disaggregation scenario holds every long prompt at once: 4 x 6,000 tokens of SmolLM2 "
                   "in fp32 are about 1.1 GiB).")
    p.add_argument("--cpu-tier", default="256MiB", help="cpu tier of each instance (faulted in at start).")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--no-disaggregation", dest="disaggregation", action="store_false",
                   help="Skip the disaggregation scenario (run with the shared-redis store).")
    p.add_argument("--streams", type=int, default=8, help="Disaggregation: decode streams running.")
    p.add_argument("--stream-tokens", type=int, default=256, help="Disaggregation: tokens each stream decodes.")
    p.add_argument("--long-prompts", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=6000)
    p.add_argument("--redis-url", default=None, help="Default: a private redis-server on loopback.")
    return parse_with_smoke(p, argv, SMOKE)


# ---- the fleet ----------------------------------------------------------------------------


def instance_flags(args: argparse.Namespace, model: str, tiers: str, redis_url: str, index: int) -> list[str]:
    cpus = sorted(os.sched_getaffinity(0))
    flags = ["--model", model, "--dtype", args.dtype, "--served-model-name", SERVED_NAME,
             "--kv-cache-memory", args.kv_pool, "--kv-offload", tiers, "--kv-offload-cpu-size", args.cpu_tier,
             "--kv-chunk-tokens", str(args.chunk_tokens), "--kv-events-config", EVENTS,
             "--max-model-len", str(longest_prompt(args) + args.max_tokens + BLOCK_SIZE),
             "--cpu-threads-bind", str(cpus[index % len(cpus)]), "--log-level", "warning"]
    if "redis" in tiers:
        flags += ["--kv-redis-url", redis_url]
    if args.smoke:
        flags.append("--no-fuse-elementwise")
    return flags


def longest_prompt(args: argparse.Namespace) -> int:
    questions = args.rounds * (args.question_tokens + args.answer_tokens)
    return max(args.doc_tokens + questions, args.latency_tokens, args.long_tokens, args.question_tokens + args.stream_tokens)


@contextmanager
def fleet(args: argparse.Namespace, model: str, tiers: str, redis_url: str) -> Iterator[list[ServerProcess]]:
    """The instances, started side by side (a start is mostly one thread importing and
    loading, so the starts overlap on the other cores); every one that started is stopped
    at the end, also when another one's start failed."""
    with ExitStack() as stack:
        with ThreadPoolExecutor(args.instances) as pool:
            starts = [pool.submit(ServerProcess, *instance_flags(args, model, tiers, redis_url, i))
                      for i in range(args.instances)]
        for start in starts:
            if start.exception() is None:
                stack.callback(start.result().stop)
        yield [start.result() for start in starts]  # a failed start raises here


@contextmanager
def router(policy: str, urls: list[str]) -> Iterator[ServerProcess]:
    front = ServerProcess("--worker-urls", *urls, "--policy", policy, "--health-check-interval", "0.5",
                          command=ROUTER)
    try:
        wait_for_pool(front.url, len(urls))
        yield front
    finally:
        front.stop()


def wait_for_pool(url: str, size: int, timeout_s: float = 120.0) -> None:
    """Until every instance is in the router's pool (its first checks run at start, but an
    instance's event stream may join a moment later)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answer = httpx.get(f"{url}/health", timeout=10).json()
        if sum(v == "healthy" for v in answer["instances"].values()) == size:
            return
        time.sleep(0.2)
    raise RuntimeError(f"router at {url}: not every instance joined in {timeout_s:.0f} s")


def counters(url: str, *names: str, **labels: str) -> dict[str, float]:
    """The sums of the samples of each counter `names` (with `labels`) in `url`'s /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        if family.name in totals:
            totals[family.name] += sum(s.value for s in family.samples if s.name.endswith("_total")
                                       and all(s.labels.get(k) == v for k, v in labels.items()))
    return totals


def fleet_counters(servers: list[ServerProcess]) -> dict[str, float]:
    totals = {"device": 0.0, "loaded": 0.0}
    for server in servers:
        found = counters(server.url, "vllm:prefix_cache_hits", "kvtier:loaded_tokens")
        totals["device"] += found["vllm:prefix_cache_hits"]
        totals["loaded"] += found["kvtier:loaded_tokens"]
    return totals


# ---- requests -----------------------------------------------------------------------------


@dataclass
class Sent:
    workload: str
    round: int
    prompt_tokens: int
    reusable_tokens: int
    cached_tokens: int
    ttft_ms: float
    latency_ms: float


def stream(client: httpx.Client, url: str, prompt: list[int], max_tokens: int, salt: str,
           user: str | None = None, on_first: Callable[[], object] = lambda: None) -> tuple[float, list[float], float, int]:
    """Stream one greedy completion: when it was sent, when each chunk with text arrived,
    when the stream ended (time.perf_counter), and its cached prompt tokens (usage);
    `on_first()` is called as the first text arrives."""
    body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    if user is not None:  # the session policy's key
        body["user"] = user
    start = time.perf_counter()
    arrivals, cached = [], 0
    with client.stream("POST", f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: {response.status_code} {response.read()[:500]!r}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):  # a token (its text may be empty: part of a character)
                arrivals.append(time.perf_counter())
                if len(arrivals) == 1:
                    on_first()
            usage = chunk.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    if not arrivals:
        raise RuntimeError(f"{url}: the stream carried no token")
    return start, arrivals, time.perf_counter(), cached


def complete(client: httpx.Client, url: str, prompt: list[int], max_tokens: int, salt: str,
             user: str | None = None) -> tuple[float, float, int]:
    """Stream one greedy completion: (TTFT ms, latency ms, cached prompt tokens)."""
    start, arrivals, end, cached = stream(client, url, prompt, max_tokens, salt, user)
    return 1000 * (arrivals[0] - start), 1000 * (end - start), cached


def reusable(prompt: list[int], earlier: list[list[int]]) -> int:
    """Whole blocks of `prompt` that an earlier prompt of the run began with."""
    best = 0
    for other in earlier:
        common = next((i for i, (a, b) in enumerate(zip(prompt, other, strict=False)) if a != b),
                      min(len(prompt), len(other)))
        best = max(best, common)
    return min(best, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE


Prompt = tuple[int, str, list[int]]  # (round, user, token ids)


def multi_round_prompts(args: argparse.Namespace, corpus: CorpusTokens, rng: random.Random) -> list[Prompt]:
    """The requests in the order they are sent: every round, the users in a random order."""
    contexts = [corpus.take(rng, args.doc_tokens) for _ in range(args.users)]
    sent = []
    for round_index in range(args.rounds):
        order = list(range(args.users))
        rng.shuffle(order)
        for user in order:
            if round_index:
                contexts[user] = contexts[user] + corpus.take(rng, args.answer_tokens)
            contexts[user] = contexts[user] + corpus.take(rng, args.question_tokens)
            sent.append((round_index, f"qa-{user}", list(contexts[user])))
    return sent


def shared_doc_prompts(args: argparse.Namespace, corpus: CorpusTokens, rng: random.Random) -> list[Prompt]:
    """One question per user on a document picked at random; the round is 0 for a
    document's first question, 1 for a later one."""
    docs = [corpus.take(rng, args.doc_tokens) for _ in range(args.docs)]
    asked = [rng.randrange(args.docs) for _ in range(args.doc_users)]
    seen: set[int] = set()
    sent = []
    for user, doc in enumerate(asked):
        sent.append((int(doc in seen), f"doc-{user}", docs[doc] + corpus.take(rng, args.question_tokens)))
        seen.add(doc)
    return sent


def run_policy(args: argparse.Namespace, servers: list[ServerProcess], policy: str,
               prompts: dict[str, list[Prompt]], salt: str) -> dict:
    with router(policy, [s.url for s in servers]) as front, httpx.Client() as client:
        before = fleet_counters(servers)
        sent: list[Sent] = []
        for workload, requests in prompts.items():
            earlier: list[list[int]] = []
            for round_index, user, prompt in requests:
                ttft, latency, cached = complete(client, front.url, prompt, args.max_tokens, salt, user)
                sent.append(Sent(workload, round_index, len(prompt), reusable(prompt, earlier), cached, ttft, latency))
                earlier.append(prompt)
        after = fleet_counters(servers)
        predicted = counters(front.url, "kvtier:router_predicted_cached_tokens", where="device")
    return summarize_policy(sent, {k: after[k] - before[k] for k in after},
                            predicted["kvtier:router_predicted_cached_tokens"])


def summarize_policy(sent: list[Sent], moved: dict[str, float], predicted_device: float) -> dict:
    reusable_total = sum(s.reusable_tokens for s in sent)
    summary = {"requests": len(sent), "reusable_tokens": reusable_total, "device_hit_tokens": moved["device"],
               "loaded_tokens": moved["loaded"], "cached_tokens": sum(s.cached_tokens for s in sent),
               "predicted_device_tokens": predicted_device,
               "device_share": moved["device"] / reusable_total if reusable_total else float("nan"),
               "cached_share": sum(s.cached_tokens for s in sent) / reusable_total if reusable_total else float("nan"),
               "records": [asdict(s) for s in sent]}
    for workload in WORKLOADS:
        later = [s.ttft_ms for s in sent if s.workload == workload and s.round > 0]
        first = [s.ttft_ms for s in sent if s.workload == workload and s.round == 0]
        summary[workload] = {"later_ttft_mean_ms": sum(later) / len(later) if later else float("nan"),
                             "first_ttft_mean_ms": sum(first) / len(first) if first else float("nan")}
    return summary


def router_latency(args: argparse.Namespace, server: ServerProcess, corpus: CorpusTokens,
                   rng: random.Random) -> dict:
    """Paired latencies of one request of --latency-tokens (a device hit after the first),
    routed and direct, in alternating order; the router's cost is their difference."""
    prompt = corpus.take(rng, args.latency_tokens)
    with router("kv", [server.url]) as front:
        direct, routed = paired_latencies(server.url, front.url, prompt, args.latency_requests)
        own = routing_buckets(front.url)  # the warm-up's and the measured requests'
    return {**added_latency(direct, routed), "own_p50_ms": bucket_quantile(own, 0.50) * 1e3,
            "own_p99_ms": bucket_quantile(own, 0.99) * 1e3}


def router_hop(args: argparse.Namespace, rng: random.Random) -> dict:
    """The router's hop alone: the paired latencies of router_latency, --hop-requests of
    them, against an instance of a tiny random model that answers in milliseconds. The
    router's work does not depend on the model (it parses the body, names the prompt's
    blocks, scores the instances and relays the answer), but a real model's answer varies
    by tens of milliseconds from one request to the next on a busy host, which buries the
    router's own p99 under the instance's."""
    context = args.latency_tokens + 2 * BLOCK_SIZE
    with tempfile.TemporaryDirectory(prefix="kvtier-hop-") as directory:
        model = make_model(directory, preset="tiny", max_position_embeddings=context)
        instance = ServerProcess("--model", model, "--served-model-name", SERVED_NAME, "--kv-cache-memory", "64MiB",
                                 "--max-model-len", str(context),
                                 "--kv-events-config", EVENTS, "--no-fuse-elementwise", "--log-level", "warning")
        try:
            prompt = [rng.randrange(HOP_TOKEN_IDS.start, HOP_TOKEN_IDS.stop) for _ in range(args.latency_tokens)]
            with router("kv", [instance.url]) as front:
                direct, routed = paired_latencies(instance.url, front.url, prompt, args.hop_requests)
        finally:
            instance.stop()
    return added_latency(direct, routed)


def paired_latencies(direct_url: str, routed_url: str, prompt: list[int], pairs: int) -> tuple[list, list]:
    """Latencies (ms) of `pairs` one-token completions of `prompt` sent direct and routed,
    which goes first alternating, after one of each as a warm-up (the prompt cached,
    connections open)."""
    direct, routed = [], []
    with httpx.Client() as client:
        for url in (direct_url, routed_url):
            complete(client, url, prompt, 1, "latency")
        for i in range(pairs):
            for url in ((direct_url, routed_url) if i % 2 == 0 else (routed_url, direct_url)):
                latency = complete(client, url, prompt, 1, "latency")[1]
                (direct if url == direct_url else routed).append(latency)
    return direct, routed


def added_latency(direct: list[float], routed: list[float]) -> dict:
    added = [r - d for r, d in zip(routed, direct, strict=True)]
    return {"direct_p50_ms": percentile(direct, 50), "routed_p50_ms": percentile(routed, 50),
            "added_p50_ms": percentile(added, 50), "added_p99_ms": percentile(added, 99), "requests": len(added)}


def routing_buckets(url: str) -> list[tuple[float, float]]:
    """The router's `kvtier:router_routing_seconds` histogram: (upper bound, cumulative count)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sorted((float(s.labels["le"]), s.value) for family in text_string_to_metric_families(text)
                  if family.name == "kvtier:router_routing_seconds"
                  for s in family.samples if s.name.endswith("_bucket"))


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """The upper bound of the bucket that holds quantile `q` (an upper bound on it)."""
    total = buckets[-1][1]
    return next(bound for bound, count in buckets if count >= q * total)


def stalls(args: argparse.Namespace, front_url: str, corpus: CorpusTokens, rng: random.Random, salt: str) -> dict:
    """--streams decodes running through the router while --long-prompts prompts of
    --long-tokens arrive (once every stream has its first token): the longest gap between
    two tokens of any stream while the long prompts are served, and their TTFT."""
    short = [corpus.take(rng, args.question_tokens) for _ in range(args.streams)]
    long = [corpus.take(rng, args.long_tokens) for _ in range(args.long_prompts)]
    decoding = threading.Semaphore(0)

    def decode(prompt: list[int]) -> list[float]:
        with httpx.Client() as client:
            return stream(client, front_url, prompt, args.stream_tokens, salt, on_first=decoding.release)[1]

    def prefill(prompt: list[int]) -> tuple[float, float]:
        with httpx.Client() as client:
            start, arrivals, end, _ = stream(client, front_url, prompt, 1, salt)
            return 1000 * (arrivals[0] - start), end

    with ThreadPoolExecutor(args.streams + args.long_prompts) as pool:
        decoders = [pool.submit(decode, p) for p in short]
        for _ in short:
            decoding.acquire(timeout=REQUEST_TIMEOUT_S)
        window_start = time.perf_counter()
        prefills = [f.result() for f in [pool.submit(prefill, p) for p in long]]
        streams = [f.result() for f in decoders]
    window_end = max(end for _, end in prefills)
    gaps = [b - a for arrivals in streams for a, b in itertools.pairwise(arrivals)
            if b >= window_start and a <= window_end]
    return {"max_gap_ms": 1000 * max(gaps, default=float("nan")),
            "long_ttft_mean_ms": sum(ttft for ttft, _ in prefills) / len(prefills),
            "streams_decoding_at_end": sum(1 for arrivals in streams if arrivals[-1] >= window_end)}


def disaggregation(args: argparse.Namespace, servers: list[ServerProcess], corpus: CorpusTokens,
                   rng: random.Random) -> dict:
    """The same instances colocated (round-robin) and disaggregated (the first prefills,
    the others decode, through the shared Redis)."""
    result = {}
    with router("round-robin", [s.url for s in servers]) as front:
        result["colocated"] = stalls(args, front.url, corpus, rng, "colocated")
    front = ServerProcess("--prefill-urls", servers[0].url, "--decode-urls", *(s.url for s in servers[1:]),
                          "--health-check-interval", "0.5", command=ROUTER)
    try:
        wait_for_pool(front.url, len(servers))
        result["disaggregated"] = stalls(args, front.url, corpus, rng, "disaggregated")
    finally:
        front.stop()
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    if args.instances < 2:
        raise SystemExit("--instances: a fleet needs at least 2")
    model, _ = checkpoint(args)
    corpus = CorpusTokens.for_model(model)
    rng = random.Random(args.seed)
    prompts = {"multi-round-qa": multi_round_prompts(args, corpus, rng),
               "shared-docs": shared_doc_prompts(args, corpus, rng)}
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": model, "stores": {}}
    with local_redis(args.redis_url) as redis_url:
        for store in args.stores:
            with fleet(args, model, STORES[store], redis_url) as servers:
                result["stores"][store] = {
                    policy: run_policy(args, servers, policy, prompts, f"{store}-{policy}-{args.seed}")
                    for policy in args.policies}
                if "latency" not in result:
                    result["latency"] = router_latency(args, servers[0], corpus, rng)
                if store == "shared-redis" and args.disaggregation:
                    result["disaggregation"] = disaggregation(args, servers, corpus, rng)
    result["hop"] = router_hop(args, rng)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    args = result["args"]
    rows = []
    for store, policies in result["stores"].items():
        for policy, s in policies.items():
            rows.append([store, policy, s["reusable_tokens"], f"{100 * s['device_share']:.0f}%",
                         f"{100 * s['cached_share']:.0f}%", s["predicted_device_tokens"],
                         s["multi-round-qa"]["later_ttft_mean_ms"], s["shared-docs"]["later_ttft_mean_ms"]])
    latency = result["latency"]
    text = (f"Fleet: {args['instances']} instances, {args['users']} users x {args['rounds']} rounds of "
            f"{args['doc_tokens']}-token contexts; {args['doc_users']} questions on {args['docs']} shared "
            f"documents; {args['dtype']}\n\n"
            + markdown_table(["store", "policy", "reusable tok", "from device", "cached (any tier)",
                              "router predicted device tok", "QA later rounds TTFT ms",
                              "shared docs later TTFT ms"], rows)
            + f"\nRouter's added latency on a {args['latency_tokens']}-token request ({latency['requests']} pairs): "
              f"p50 {latency['added_p50_ms']:.2f} ms, p99 {latency['added_p99_ms']:.2f} ms "
              f"(direct p50 {latency['direct_p50_ms']:.1f} ms, routed p50 {latency['routed_p50_ms']:.1f} ms)"
            + (f"; the router's own time before sending (its kvtier:router_routing_seconds histogram): "
               f"p50 <= {latency['own_p50_ms']:g} ms, p99 <= {latency['own_p99_ms']:g} ms" if "own_p50_ms" in latency
               else "") + "\n")
    if "hop" in result:
        hop = result["hop"]
        text += (f"\nThe router's hop alone, against a tiny-model instance ({hop['requests']} pairs): added "
                 f"p50 {hop['added_p50_ms']:.2f} ms, p99 {hop['added_p99_ms']:.2f} ms (direct p50 "
                 f"{hop['direct_p50_ms']:.1f} ms, routed p50 {hop['routed_p50_ms']:.1f} ms); target p50 <= "
                 f"{HOP_TARGET_MS[0]:g} ms, p99 <= {HOP_TARGET_MS[1]:g} ms\n")
    if "disaggregation" in result:
        runs = result["disaggregation"]
        text += (f"\nDisaggregation: {args['streams']} decode streams while {args['long_prompts']} prompts of "
                 f"{args['long_tokens']} tokens arrive\n\n"
                 + markdown_table(["setup", "longest inter-token gap ms", "long prompts' mean TTFT ms",
                                   "streams still decoding at the end"],
                                  [[name, r["max_gap_ms"], r["long_ttft_mean_ms"], r["streams_decoding_at_end"]]
                                   for name, r in runs.items()]))
    return text


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    sentences = []
    for store, policies in result["stores"].items():
        if "kv" not in policies or "round-robin" not in policies:
            continue
        kv, rr = policies["kv"], policies["round-robin"]
        ratio = kv["multi-round-qa"]["later_ttft_mean_ms"] / rr["multi-round-qa"]["later_ttft_mean_ms"]
        sentences.append(
            f"With {store}, the kv policy served {100 * kv['device_share']:.0f}% of the reusable prompt tokens "
            f"from the chosen instance's device cache against round-robin's {100 * rr['device_share']:.0f}%, "
            f"and its later multi-round QA rounds took {ratio:.2f}x round-robin's mean TTFT.")
    if "disaggregation" in result:
        runs = result["disaggregation"]
        sentences.append(
            f"Disaggregated, the longest inter-token gap of the running streams was "
            f"{runs['disaggregated']['max_gap_ms'] / runs['colocated']['max_gap_ms']:.2f}x the colocated one's "
            f"({runs['disaggregated']['max_gap_ms']:.0f} against {runs['colocated']['max_gap_ms']:.0f} ms), the long "
            f"prompts' mean TTFT {runs['disaggregated']['long_ttft_mean_ms']:.0f} against "
            f"{runs['colocated']['long_ttft_mean_ms']:.0f} ms.")
    latency = result["latency"]
    sentences.append(f"The router added {latency['added_p50_ms']:.2f} ms at p50 and {latency['added_p99_ms']:.2f} ms "
                     f"at p99 to a {result['args']['latency_tokens']}-token request"
                     + (f", of which its own work before sending was at most {latency['own_p50_ms']:g} ms at p50 "
                        f"and {latency['own_p99_ms']:g} ms at p99 (the rest is the extra hop and the instance's "
                        f"own variation between the paired requests)." if "own_p50_ms" in latency else "."))
    if "hop" in result:
        hop = result["hop"]
        met = hop["added_p50_ms"] <= HOP_TARGET_MS[0] and hop["added_p99_ms"] <= HOP_TARGET_MS[1]
        sentences.append(f"Against an instance that answers in {hop['direct_p50_ms']:.0f} ms, where the pairs differ "
                         f"by the router alone, it added {hop['added_p50_ms']:.2f} ms at p50 and "
                         f"{hop['added_p99_ms']:.2f} ms at p99: the target (p50 <= {HOP_TARGET_MS[0]:g} ms, p99 <= "
                         f"{HOP_TARGET_MS[1]:g} ms) is {'met' if met else 'missed'}.")
    return " ".join(sentences)


def plot(result: dict) -> None:
    labels = [f"{store}\n{policy}" for store, policies in result["stores"].items() for policy in policies]
    runs = [s for policies in result["stores"].values() for s in policies.values()]
    shares = {"device": [100 * s["device_share"] for s in runs], "any tier": [100 * s["cached_share"] for s in runs]}
    ttfts = {workload: [s[workload]["later_ttft_mean_ms"] for s in runs] for workload in WORKLOADS}
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Reusable prompt tokens served from cache", "", "%", labels, shares, kind="bar"),
        plots.Panel("Mean TTFT of later rounds", "", "ms", labels, ttfts, kind="bar"),
    ], "A fleet behind kvtier router")

