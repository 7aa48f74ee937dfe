"""Throughput without reuse: random prompts at concurrency 1, 8, 32, 64.

The table shape of seed 000 section 5 (input 512 + output 128 tokens, a KV space of
22,048 tokens, concurrency 1/8/32/64: throughput, median TTFT, preemptions). C
closed-loop clients each send a prompt of random tokens (no two prompts share a
prefix), wait for its answer and send the next. Systems, same weights, same run, one
concurrency level at a time:

- engine:          our engine, device KV pool of --num-kv-blocks, recompute preemption;
- engine-offload:  the same with --kv-offload cpu (offload preemption: a preempted
                   request's KV goes to the cpu tier and is loaded back on resume);
- hf-generate:     transformers `generate` in static batches of C prompts;
- hf-cb:           transformers continuous batching (`generate_batch`'s manager), C
                   clients, the same KV capacity and per-step token budget.

The transformers baselines run at --hf-concurrency levels only, on the first
max(C, --hf-requests) prompts of a level (all prompts have the same length, so one
wave already runs at full batch): on CPU they are slow enough that the full grid
would take most of an hour.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from transformers import PreTrainedModel

from bench import hf_baselines, plots
from bench.common import markdown_table
from bench.driver import (
    VARIANTS,
    Turn,
    add_engine_args,
    engine_config,
    parse_workload_args,
    replay,
    variant_llm,
)
from bench.profiling import profile_requests, profile_sentence, render_profile
from bench.summary import publish, result_header, run_summary
from bench.text_corpus import CorpusTokens

NAME = "throughput"
SYSTEMS = ("engine", "engine-offload", "hf-generate", "hf-cb")
ENGINE_VARIANTS = {"engine": VARIANTS["no-offload"], "engine-offload": VARIANTS["cpu"]}
SEED_KV_TOKENS = 22048  # the seed's measured KV space
# Seed 000 section 5 (Qwen3-1.7B on an 8 GB laptop GPU, vLLM 0.31, 512 + 128 tokens):
# concurrency -> (output tok/s, median TTFT ms).
SEED = {1: (66, 73), 8: (383, 351), 32: (831, 666), 64: (787, 5700)}
PROFILE_BATCHES = (1, 8)
PAR = 0.95  # a transformers / engine work ratio above this is within run-to-run spread of par
SMOKE = {"concurrency": [1, 4], "hf_concurrency": [1, 4], "hf_requests": 2, "prompt_len": 32, "output_len": 4,
         "requests_per_client": 1, "min_requests": 2, "num_kv_blocks": 32}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8, help="At least this many requests per level.")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    p.add_argument("--hf-concurrency", type=int, nargs="+", default=[1, 8, 32],
                   help="Levels at which the transformers baselines run.")
    p.add_argument("--hf-requests", type=int, default=8, help="Transformers runs max(C, this) requests per level.")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    add_engine_args(p, num_kv_blocks=SEED_KV_TOKENS // 16, max_num_seqs=256)
    return parse_workload_args(p, argv, SMOKE)


@dataclass
class Client:
    """A closed-loop client: its next prompt goes out as soon as its answer is back."""

    prompts: list[list[int]]
    output_len: int
    tag: str
    sent: int = field(default=0)

    @property
    def num_turns(self) -> int:
        return len(self.prompts)

    def next_turn(self, answer: list[int] | None, now: float) -> tuple[float, Turn] | None:
        if self.sent == len(self.prompts):
            return None
        self.sent += 1
        return now, Turn(self.prompts[self.sent - 1], self.output_len, self.tag)


def level_prompts(args: argparse.Namespace, concurrency: int, corpus: CorpusTokens) -> list[list[list[int]]]:
    """Per client, its prompts: runs of real text from distinct seeds, so no prefix is shared."""
    per_client = max(args.requests_per_client, -(-args.min_requests // concurrency))
    return [[corpus.take(random.Random(f"{args.seed}-{concurrency}-{c}-{i}"), args.prompt_len)
             for i in range(per_client)] for c in range(concurrency)]


def run_level(args: argparse.Namespace, hf_model: PreTrainedModel | None, concurrency: int, corpus: CorpusTokens) -> dict[str, dict]:
    prompts = level_prompts(args, concurrency, corpus)
    runs = {}
    for system in args.systems:
        if system in ENGINE_VARIANTS:
            runs[system] = run_engine(args, system, prompts)
        elif concurrency in args.hf_concurrency:
            runs[system] = run_hf(args, hf_model, system, prompts)
    return runs


def run_engine(args: argparse.Namespace, system: str, prompts: list[list[list[int]]]) -> dict:
    concurrency = len(prompts)
    with variant_llm(args, ENGINE_VARIANTS[system]) as llm:
        clients = [Client(own, args.output_len, str(concurrency)) for own in prompts]
        run = replay(llm, clients, f"{system} c={concurrency}")
        summary = run_summary(run)
        summary["engine_config"] = engine_config(llm)
    return summary


def run_hf(args: argparse.Namespace, model: PreTrainedModel, system: str, prompts: list[list[list[int]]]) -> dict:
    """The first max(C, --hf-requests) prompts in round order: the clients' first prompts
    (the first static batch), then their second ones, and so on."""
    concurrency = len(prompts)
    ordered = [own[i] for i in range(len(prompts[0])) for own in prompts][: max(concurrency, args.hf_requests)]
    if system == "hf-generate":
        run = hf_baselines.static_batches(model, ordered, args.output_len, concurrency, str(concurrency))
    else:
        run = hf_baselines.continuous_batching(model, ordered, args.output_len, concurrency, 16 * args.num_kv_blocks,
                                               args.max_num_batched_tokens, str(concurrency))
    summary = run_summary(run)
    summary["overall"]["preemptions"] = None
    return summary


def profiles(args: argparse.Namespace, corpus: CorpusTokens) -> list[dict]:
    """The engine's two regimes: one request alone (per-step overhead is not shared) and
    a batch of cold requests prefilled and decoded together."""
    results = []
    for batch in PROFILE_BATCHES:
        prompts = [own[0] for own in level_prompts(args, batch, corpus)]
        with variant_llm(args, VARIANTS["no-offload"]) as llm:
            label = f"{batch} cold request{'s' if batch > 1 else ''} at once"
            results.append(profile_requests(llm, prompts, args.output_len, label))
    return results


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    result = result_header(NAME, argv, args)
    hf_model = None
    if {"hf-generate", "hf-cb"} & set(args.systems):
        hf_model = hf_baselines.load_model(result["model"]["path"], args.dtype)
    corpus = CorpusTokens.for_model(result["model"]["path"])
    result["levels"] = {str(c): run_level(args, hf_model, c, corpus) for c in args.concurrency}
    if args.profile:
        result["profiles"] = profiles(args, corpus)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    opts = result["options"]
    text = (f"{opts['prompt_len']}-token random prompts, {opts['output_len']} output tokens, no shared prefixes; "
            f"device KV pool {16 * opts['num_kv_blocks']} tokens, token budget {opts['max_num_batched_tokens']}. "
            "Output tokens per CPU-second count the work whatever else shares the cores; the ratio column "
            "compares it with the engine's at the same concurrency.\n\n")
    rows = []
    for concurrency, systems in result["levels"].items():
        base = systems.get("engine", {}).get("overall", {}).get("output_tok_per_cpu_s")
        for system, run in systems.items():
            o = run["overall"]
            ratio = o["output_tok_per_cpu_s"] / base if base else float("nan")
            pre = "n/a" if o["preemptions"] is None else o["preemptions"]
            rows.append([concurrency, system, o["requests"], o["output_tok_s"], o["output_tok_per_cpu_s"],
                         o["ttft_p50_ms"], o["ttft_p99_ms"], pre, ratio])
    text += markdown_table(["concurrency", "system", "requests", "output tok/s", "output tok/CPU-s", "TTFT p50 ms",
                            "TTFT p99 ms", "preemptions", "ratio"], rows)
    seed = [[c, tok_s, ttft] for c, (tok_s, ttft) in SEED.items()]
    text += ("\nThe seed's table (vLLM, Qwen3-1.7B, 8 GB laptop GPU), for its shape:\n\n"
             + markdown_table(["concurrency", "output tok/s", "TTFT p50 ms"], seed))
    for prof in result.get("profiles", []):
        text += "\n" + render_profile(prof)
    return text


def series(result: dict, key: str) -> dict[str, list[float]]:
    """Per system, its value at every level (NaN where it did not run)."""
    levels = result["levels"].values()
    systems = dict.fromkeys(s for level in levels for s in level)
    return {s: [level[s]["overall"][key] if s in level else float("nan") for level in levels] for s in systems}


def plot(result: dict) -> None:
    x = [int(c) for c in result["levels"]]
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Output throughput (wall clock)", "concurrent clients", "output tokens/s", x,
                    series(result, "output_tok_s")),
        plots.Panel("Output tokens per CPU-second", "concurrent clients", "tokens / CPU-s", x,
                    series(result, "output_tok_per_cpu_s")),
        plots.Panel("Time to first token (median)", "concurrent clients", "ms", x, series(result, "ttft_p50_ms"),
                    logy=True),
    ], "Random prompts without reuse")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    levels = {int(c): systems for c, systems in result["levels"].items()}
    engine = {c: s["engine"]["overall"] for c, s in levels.items() if "engine" in s}
    if not engine:
        return ""
    text = _scaling_sentence(engine) + _pressure_sentence(result, engine)
    text += _offload_sentence(levels) + _baseline_sentence(levels)
    for prof in result.get("profiles", []):
        text += " " + profile_sentence(prof)
    return text


def _scaling_sentence(engine: dict[int, dict]) -> str:
    low, best = min(engine), max(engine, key=lambda c: engine[c]["output_tok_per_cpu_s"])
    a, b = engine[low], engine[best]
    return (f"The engine makes {a['output_tok_s']:.0f} output tok/s at concurrency {low} and "
            f"{b['output_tok_s']:.0f} at {best} ({a['output_tok_per_cpu_s']:.0f} and "
            f"{b['output_tok_per_cpu_s']:.0f} per CPU-second, "
            f"{b['output_tok_per_cpu_s'] / a['output_tok_per_cpu_s']:.1f}x): a decode step reads the weights once "
            "for every running request, so batching pays until the pool or the compute runs out. ")


def _pressure_sentence(result: dict, engine: dict[int, dict]) -> str:
    o = result["options"]
    pool, per_request = 16 * o["num_kv_blocks"], o["prompt_len"] + o["output_len"]
    high = max(engine)
    below = max((c for c in engine if c < high), default=high)
    text = (f"The {pool}-token pool holds about {pool // per_request} requests of {per_request} tokens; at {high} "
            f"clients the median TTFT is {engine[high]['ttft_p50_ms']:.0f} ms against "
            f"{engine[below]['ttft_p50_ms']:.0f} ms at {below}")
    if engine[high]["preemptions"]:
        return text + (f", with {engine[high]['preemptions']} preemptions: requests wait for blocks and preempted "
                       "ones compute their prompt again. ")
    return text + ", without preemptions: requests queue behind each other's prefill. "


def _offload_sentence(levels: dict[int, dict]) -> str:
    high = max(levels)
    systems = levels[high]
    if "engine" not in systems or "engine-offload" not in systems:
        return ""
    base, offload = systems["engine"], systems["engine-offload"]
    recomputed = [run["stats_delta"].get("num_recomputed_tokens", 0) for run in (base, offload)]
    loaded = offload["stats_delta"].get("kv_loaded_tokens", 0)
    return (f"With --kv-offload cpu, preempted requests come back from the cpu tier: at {high} clients "
            f"{recomputed[1]:.0f} tokens are computed a second time instead of {recomputed[0]:.0f} "
            f"({loaded:.0f} loaded); that is "
            f"{offload['overall']['output_tok_per_cpu_s'] / base['overall']['output_tok_per_cpu_s']:.2f}x the "
            f"work per CPU-second, with a TTFT p99 of {offload['overall']['ttft_p99_ms']:.0f} ms against "
            f"{base['overall']['ttft_p99_ms']:.0f} ms. ")


def _baseline_sentence(levels: dict[int, dict]) -> str:
    parts = []
    for concurrency, systems in levels.items():
        for system in ("hf-generate", "hf-cb"):
            ratio = _hf_ratio(systems, system)
            if ratio:
                parts.append(f"{system} {ratio:.2f}x at {concurrency}")
    if not parts:
        return ""
    text = ("Transformers on the same weights, output tokens per CPU-second as a fraction of the engine's: "
            + ", ".join(parts) + ".")
    close = [c for c, systems in levels.items()
             if any(_hf_ratio(systems, s) >= PAR for s in ("hf-generate", "hf-cb"))]
    if close:
        text += (f" Where transformers is on par or ahead (concurrency {', '.join(map(str, close))}), the batch is "
                 "too small to amortize the engine's per-step Python work (scheduling, batch metadata, "
                 "detokenization): compare the host share of the one-request profile with the batched one.")
    return text


def _hf_ratio(systems: dict, system: str) -> float:
    base = systems.get("engine", {}).get("overall", {}).get("output_tok_per_cpu_s")
    if not base or system not in systems:
        return 0.0
    return systems[system]["overall"]["output_tok_per_cpu_s"] / base
