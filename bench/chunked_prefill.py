"""Chunked prefill: inter-token latency of one decoding request while long prompts arrive.

The table shape of seed 000 section 3: one request decodes while long prompts
(3 x 3,500 tokens) are inserted one after another; for each per-step token budget
(--max-num-batched-tokens 512, 1,024, 2,048, 8,192) the max and p99 gap between the
decoding request's tokens during the insertions, and the long prompts' own TTFT.

Inter-token gaps are measured by timing every `engine.step()` and noting which steps
produced a token for the decoding request, in wall time (what a client sees) and in
this process's CPU time (what the steps cost, whatever else shares the cores). The insertion window runs from the first
long prompt's arrival to the first token of the last one. A long prompt is inserted
once the decode has made --gap-tokens tokens after the previous long prompt's first
token. Budgets are interleaved across --repeats.
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass, field

from bench import plots
from bench.common import markdown_table, median, percentile
from bench.console import progress
from bench.driver import (
    add_engine_args,
    engine_config,
    greedy,
    parse_workload_args,
    variant_llm,
)
from bench.profiling import profile_requests, profile_sentence, render_profile
from bench.summary import publish, result_header
from bench.text_corpus import CorpusTokens
from engine import LLM, LLMEngine

NAME = "chunked-prefill"
# Seed 000 section 3 (Qwen3-1.7B on an 8 GB laptop GPU, vLLM 0.31, 3,000-token decode,
# 3 x 3,500-token insertions): budget -> max inter-token gap ms during the insertions.
SEED_MAX_GAP_MS = {512: 69, 1024: 129, 2048: 227, 8192: 445}
DECODE_ID = "decode"
SMOKE = {"budgets": [32, 128], "long_prompt_len": 96, "num_long_prompts": 2, "decode_prompt_len": 16,
         "warmup_tokens": 2, "gap_tokens": 1, "tail_tokens": 2, "repeats": 1, "num_kv_blocks": 64}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 8192],
                   help="Per-step token budgets (--max-num-batched-tokens) to compare.")
    p.add_argument("--long-prompt-len", type=int, default=3500)
    p.add_argument("--num-long-prompts", type=int, default=3)
    p.add_argument("--decode-prompt-len", type=int, default=256)
    p.add_argument("--warmup-tokens", type=int, default=8, help="Decode tokens before the first insertion.")
    p.add_argument("--gap-tokens", type=int, default=4, help="Decode tokens between insertions.")
    p.add_argument("--tail-tokens", type=int, default=8, help="Decode tokens after the last insertion.")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-profile", dest="profile", action="store_false")
    add_engine_args(p, num_kv_blocks=1024)
    return parse_workload_args(p, argv, SMOKE)


@dataclass
class Trace:
    """What one measurement saw: when the decode's tokens came (end of the step that made
    each, wall and CPU clock), when each long prompt arrived and got its first token."""

    token_times: list[float] = field(default_factory=list)
    token_cpu_times: list[float] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    first_tokens: list[float] = field(default_factory=list)


class Insertions:
    """Decides when the next long prompt goes in, from the decode's progress."""

    def __init__(self, args: argparse.Namespace, prompts: list[list[int]]) -> None:
        self.args = args
        self.prompts = prompts
        self.next_at = args.warmup_tokens

    def due(self, trace: Trace) -> list[int] | None:
        waiting = len(trace.arrivals) > len(trace.first_tokens)
        if waiting or len(trace.arrivals) == len(self.prompts) or len(trace.token_times) < self.next_at:
            return None
        return self.prompts[len(trace.arrivals)]

    def answered(self, trace: Trace) -> None:
        self.next_at = len(trace.token_times) + self.args.gap_tokens

    def done(self, trace: Trace) -> bool:
        finished = len(trace.first_tokens) == len(self.prompts)
        return finished and len(trace.token_times) >= self.next_at + self.args.tail_tokens


def decode_tokens_needed(args: argparse.Namespace) -> int:
    """An upper bound on the decode tokens one measurement takes: a long prompt's prefill
    shares each step with one decode token, so it spans at most L / (budget - 1) + 1 steps."""
    per_insert = args.gap_tokens + -(-args.long_prompt_len // (min(args.budgets) - 1)) + 1
    return args.warmup_tokens + args.tail_tokens + args.num_long_prompts * per_insert + 1


def measure(llm: LLM, args: argparse.Namespace, corpus: CorpusTokens, repeat: int) -> Trace:
    rng = random.Random(f"{args.seed}-{repeat}")
    engine = llm.engine
    prompts = [corpus.take(rng, args.long_prompt_len) for _ in range(args.num_long_prompts)]
    plan = Insertions(args, prompts)
    trace = Trace()
    decode_prompt = corpus.take(rng, args.decode_prompt_len)
    engine.add_request(DECODE_ID, decode_prompt, greedy(decode_tokens_needed(args)))
    while not plan.done(trace) and engine.has_unfinished_requests():
        prompt = plan.due(trace)
        if prompt is not None:
            engine.add_request(f"long-{len(trace.arrivals)}", prompt, greedy(1))
            trace.arrivals.append(time.monotonic())
        _step(engine, trace, plan)
    engine.abort_request([DECODE_ID])
    return trace


def _step(engine: LLMEngine, trace: Trace, plan: Insertions) -> None:
    outputs = engine.step()
    now, cpu = time.monotonic(), time.process_time()
    for out in outputs:
        if out.request_id == DECODE_ID and out.new_token_ids:
            trace.token_times.append(now)
            trace.token_cpu_times.append(cpu)
        elif out.request_id != DECODE_ID and out.finished:
            trace.first_tokens.append(out.metrics.first_token_time)
            plan.answered(trace)


def analyse(trace: Trace) -> dict:
    """Gaps between the decode's tokens (wall and CPU), split into those overlapping the
    insertion window and the decode-only ones outside it; the long prompts' TTFT."""
    times, cpu = trace.token_times, trace.token_cpu_times
    start, end = trace.arrivals[0], trace.first_tokens[-1]
    gaps = [(times[k] - times[k - 1], times[k - 1] < end and times[k] > start) for k in range(1, len(times))]
    inside = [1000 * g for g, in_window in gaps if in_window]
    outside = [1000 * g for g, in_window in gaps if not in_window]
    cpu_inside = [1000 * (cpu[k + 1] - cpu[k]) for k, (_, in_window) in enumerate(gaps) if in_window]
    return {
        "max_gap_ms": max(inside),
        "p99_gap_ms": percentile(inside, 99),
        "max_gap_cpu_ms": max(cpu_inside),
        "p50_gap_ms": median(inside),
        "decode_only_p50_ms": median(outside),
        "gaps_in_window": len(inside),
        "ttft_ms": [1000 * (f - a) for a, f in zip(trace.arrivals, trace.first_tokens, strict=True)],
        "gaps_ms": [1000 * g for g, _ in gaps],
        "window_s": end - start,
    }


def run_budgets(args: argparse.Namespace, corpus: CorpusTokens) -> dict[str, dict]:
    """Every budget once per repeat, budgets interleaved, a fresh engine each time."""
    runs: dict[str, dict] = {str(b): {"measurements": []} for b in args.budgets}
    plan = [(repeat, budget) for repeat in range(args.repeats) for budget in args.budgets]
    for repeat, budget in progress(plan, desc="budget x repeat"):
        with variant_llm(args, {}, max_num_batched_tokens=budget) as llm:
            trace = measure(llm, args, corpus, repeat)
            runs[str(budget)]["engine_config"] = engine_config(llm)
        runs[str(budget)]["measurements"].append(analyse(trace))
    for budget, run in runs.items():
        run["summary"] = summarize_budget(int(budget), args.long_prompt_len, run["measurements"])
    return runs


def summarize_budget(budget: int, long_prompt_len: int, measurements: list[dict]) -> dict:
    ttfts = [t for m in measurements for t in m["ttft_ms"]]
    return {
        "chunk_tokens": min(budget - 1, long_prompt_len),
        "max_gap_ms": median([m["max_gap_ms"] for m in measurements]),
        "max_gap_each_ms": [m["max_gap_ms"] for m in measurements],
        "max_gap_cpu_ms": median([m["max_gap_cpu_ms"] for m in measurements]),
        "p99_gap_ms": median([m["p99_gap_ms"] for m in measurements]),
        "decode_only_p50_ms": median([m["decode_only_p50_ms"] for m in measurements]),
        "ttft_min_ms": min(ttfts),
        "ttft_max_ms": max(ttfts),
        "ttft_p50_ms": median(ttfts),
    }


def profile(args: argparse.Namespace, corpus: CorpusTokens) -> dict:
    """The slowest step: one whole long prompt prefilled under the largest budget."""
    prompt = corpus.take(random.Random(f"{args.seed}-profile"), args.long_prompt_len)
    budget = max(args.budgets)
    with variant_llm(args, {}, max_num_batched_tokens=budget) as llm:
        return profile_requests(llm, [prompt], 1, f"a {args.long_prompt_len}-token prefill, budget {budget}")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    result = result_header(NAME, argv, args)
    corpus = CorpusTokens.for_model(result["model"]["path"])
    result["budgets"] = run_budgets(args, corpus)
    if args.profile:
        result["profile"] = profile(args, corpus)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    o = result["options"]
    text = (f"One request decodes ({o['decode_prompt_len']}-token prompt) while {o['num_long_prompts']} prompts of "
            f"{o['long_prompt_len']} tokens arrive one after another; medians over {o['repeats']} repeat(s) "
            "(each repeat's max gap listed). CPU: the same gap in this process's CPU time.\n\n")
    rows = []
    for budget, run in result["budgets"].items():
        s = run["summary"]
        each = ", ".join(f"{g:.0f}" for g in s["max_gap_each_ms"])
        rows.append([budget, s["chunk_tokens"], f"{s['max_gap_ms']:.0f} ({each})", s["max_gap_cpu_ms"],
                     s["p99_gap_ms"], s["decode_only_p50_ms"], f"{s['ttft_min_ms']:.0f}-{s['ttft_max_ms']:.0f}",
                     SEED_MAX_GAP_MS.get(int(budget), "")])
    text += markdown_table(["token budget", "prefill chunk", "max inter-token gap ms", "max gap CPU ms", "p99 gap ms",
                            "decode-only gap p50 ms", "long prompt TTFT ms", "seed max gap ms (GPU)"], rows)
    if "profile" in result:
        text += "\n" + render_profile(result["profile"])
    return text


def plot(result: dict) -> None:
    budgets = list(result["budgets"])
    timelines = {b: run["measurements"][0]["gaps_ms"] for b, run in result["budgets"].items()}
    length = max(map(len, timelines.values()))
    padded = {f"budget {b}": gaps + [float("nan")] * (length - len(gaps)) for b, gaps in timelines.items()}
    summaries = [result["budgets"][b]["summary"] for b in budgets]
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Gap before each decode token (first repeat)", "decode token", "ms", list(range(1, length + 1)),
                    padded, logy=True),
        plots.Panel("Inter-token gap during insertions", "token budget", "ms", budgets,
                    {"max (wall)": [s["max_gap_ms"] for s in summaries],
                     "max (CPU time)": [s["max_gap_cpu_ms"] for s in summaries],
                     "p99 (wall)": [s["p99_gap_ms"] for s in summaries]},
                    kind="bar"),
    ], "Chunked prefill: a decoding request while long prompts arrive")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    runs = {int(b): r["summary"] for b, r in result["budgets"].items()}
    low, high = min(runs), max(runs)
    a, b = runs[low], runs[high]
    text = (f"With a budget of {low} tokens the decoding request's worst gap during the insertions is "
            f"{a['max_gap_ms']:.0f} ms ({a['max_gap_cpu_ms']:.0f} ms of CPU time); with {high} (an effective chunk "
            f"of {b['chunk_tokens']} tokens) it is {b['max_gap_ms']:.0f} ms ({b['max_gap_cpu_ms']:.0f} ms of CPU), "
            f"{b['max_gap_cpu_ms'] / a['max_gap_cpu_ms']:.1f}x in CPU time for a "
            f"{b['chunk_tokens'] / a['chunk_tokens']:.1f}x larger chunk. A step lasts as long as its prefill chunk "
            "and the decode's next token waits for the whole step, so the gap follows the chunk size"
            f"{_proportionality(a, b)}; between insertions a decode-only step takes "
            f"{a['decode_only_p50_ms']:.0f} ms. The long prompts' own TTFT is "
            f"{a['ttft_p50_ms']:.0f} ms (median) at {low} and {b['ttft_p50_ms']:.0f} ms at {high}: small chunks "
            "cost the long prompt little and spare the running decode a lot.")
    if low in SEED_MAX_GAP_MS and high in SEED_MAX_GAP_MS:
        text += (f" The seed's GPU run has the same shape, {SEED_MAX_GAP_MS[low]} ms to {SEED_MAX_GAP_MS[high]} ms "
                 f"({SEED_MAX_GAP_MS[high] / SEED_MAX_GAP_MS[low]:.1f}x); each step here costs about "
                 f"{a['max_gap_cpu_ms'] / SEED_MAX_GAP_MS[low]:.0f}x more on one CPU core.")
    if "profile" in result:
        text += " " + profile_sentence(result["profile"])
    return text


def _proportionality(small: dict, large: dict) -> str:
    gap_ratio = large["max_gap_cpu_ms"] / small["max_gap_cpu_ms"]
    if gap_ratio < large["chunk_tokens"] / small["chunk_tokens"]:
        return (" (less than proportionally: the worst small chunk is a prompt's last, which attends to the "
                "most context)")
    return ""
