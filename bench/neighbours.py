"""Batch-1 decode and prefix-hit TTFT beside neighbours that take CPU (bench/neighbour_load.py:
none, a busy loop, another torch process, a crowd of three).

The servers (kvtier in each of --kvtier-variants: by default as it starts and with its
seat keeper; and vLLM's CPU build given --vllm-venv) stay up together and each first reads a --doc-tokens document once.
Then, per round, each neighbour set in turn is started, every server streams the same
document again (a device prefix hit) for --decode-tokens tokens, the order of the servers
rotating from round to round, and the neighbours are stopped. A request's TTFT is the
prefix hit's; the median gap between its later tokens is the batch-1 decode, and their
mean (TPOT, vLLM's time per output token) says whether a median hides bursts.
"""

from __future__ import annotations

import argparse
import os

from bench import plots
from bench.common import markdown_table, median, parse_with_smoke
from bench.console import echo
from bench.neighbour_load import NEIGHBOURS, neighbours
from bench.openai_probe import stream_completion
from bench.schedstat import tree_cpu_seconds, wait_until_idle
from bench.served_engines import KVTIER, SERVED_NAME, VLLM, add_server_args, running_servers
from bench.summary import publish, result_header
from bench.text_corpus import token_documents
from engine.models import load_tokenizer

NAME = "neighbours"
SUMMARIZED = ("hit_ttft_s", "decode_s", "tpot_s", "ran_s", "waited_s")
SMOKE = {"rounds": 1, "doc_tokens": 96, "decode_tokens": 6, "max_model_len": 512, "kv_pool": "64MiB",
         "neighbour_sets": ["quiet", "busy loop"], "server_args": "--no-fuse-elementwise"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    p.set_defaults(kvtier_variants=["", "--cpu-seat-keeper"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--neighbour-sets", nargs="+", default=list(NEIGHBOURS), choices=list(NEIGHBOURS),
                   metavar="SET", help=f"Which neighbours, in this order: {', '.join(NEIGHBOURS)}.")
    p.add_argument("--seed", type=int, default=0)
    return parse_with_smoke(p, argv, SMOKE)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    result = result_header(NAME, argv, args)
    doc = token_documents(load_tokenizer(result["model"]["path"]), [args.doc_tokens], seed=args.seed)[0]
    samples: dict[str, dict[str, list[dict[str, float]]]] = {s: {} for s in args.neighbour_sets}
    with running_servers(args) as servers:
        for server in servers.values():
            stream_completion(server.url, SERVED_NAME, doc, 2)  # the document, read once
        names = list(servers)
        for round_ in range(args.rounds):
            for neighbour_set in args.neighbour_sets:
                with neighbours(neighbour_set):
                    shift = round_ % len(names)
                    for name in names[shift:] + names[:shift]:
                        settled_s = wait_until_idle([server.pid for server in servers.values()])
                        ran, waited = tree_cpu_seconds(servers[name].pid)
                        timing = stream_completion(servers[name].url, SERVED_NAME, doc, args.decode_tokens)
                        ran_after, waited_after = tree_cpu_seconds(servers[name].pid)
                        sample = {"hit_ttft_s": timing.ttft_s, "decode_s": median(timing.inter_token_s),
                                  "tpot_s": timing.tpot_s,
                                  "ran_s": ran_after - ran, "waited_s": waited_after - waited,
                                  "load": os.getloadavg()[0], "settled_s": settled_s}
                        samples[neighbour_set].setdefault(name, []).append(sample)
                        echo(f"round {round_}, {neighbour_set}: {name}: hit TTFT {1000 * timing.ttft_s:.0f} ms, "
                             f"decode {1000 * sample['decode_s']:.1f} ms/token, TPOT {1000 * timing.tpot_s:.1f} ms "
                             f"(load {sample['load']:.1f})")
    result["samples"] = samples
    result["summary"] = {s: {name: {key: median([x[key] for x in runs]) for key in SUMMARIZED}
                             for name, runs in by_server.items()}
                         for s, by_server in samples.items()}
    plot(result)
    publish(NAME, result, render(result))
    return 0


def baseline_names(names: list[str]) -> list[str]:
    """The servers kvtier's default is compared with: its variants first, then vLLM."""
    return [n for n in names if n != KVTIER]


def render(result: dict) -> str:
    o, summary = result["options"], result["summary"]
    names = list(next(iter(summary.values())))
    others = baseline_names(names) if KVTIER in names else []
    measured = next(iter(next(iter(summary.values())).values()))  # one server's summary: which keys exist
    has_tpot = "tpot_s" in measured
    headers = ["neighbours", *[f"{n}: hit TTFT ms" for n in names], *[f"{n}: decode ms" for n in names],
               *([f"{n}: TPOT ms" for n in names] if has_tpot else []),
               *[f"kvtier / {n}: TTFT, decode{', TPOT' if has_tpot else ''}" for n in others]]
    ratio_keys = ("hit_ttft_s", "decode_s", *(("tpot_s",) if has_tpot else ()))
    rows = []
    for neighbour_set, by_server in summary.items():
        mine = by_server.get(KVTIER)
        rows.append([neighbour_set, *[1000 * by_server[n]["hit_ttft_s"] for n in names],
                     *[1000 * by_server[n]["decode_s"] for n in names],
                     *([1000 * by_server[n]["tpot_s"] for n in names] if has_tpot else []),
                     *[", ".join(f"{mine[key] / by_server[n][key]:.2f}" for key in ratio_keys) for n in others]])
    text = (f"{o['rounds']} rounds, medians; a {o['doc_tokens']}-token document read again (device prefix hit), "
            f"{o['decode_tokens']} tokens streamed; --dtype {o['dtype']}; load average "
            f"{result['load_average_start'][0]:.1f} at the start (the neighbours add to it); before each request "
            f"the bench waits until every server is idle (at most 15 s: one still polling after its request "
            f"would slow the next)\n\n"
            + markdown_table(headers, rows))
    if "ran_s" in measured:
        text += ("\nWhere a request's time went (medians per request, every thread of the server's processes, "
                 "from /proc/PID/task/*/schedstat): CPU seconds run, and seconds waited runnable while another "
                 "process had the CPU\n\n")
        text += markdown_table(["neighbours", *[f"{n}: ran s, waited s" for n in names]],
                               [[s, *[f"{by[n]['ran_s']:.2f}, {by[n]['waited_s']:.2f}" for n in names]]
                                for s, by in summary.items()])
    return text


def plot(result: dict) -> None:
    summary = result["summary"]
    sets = list(summary)
    names = list(summary[sets[0]])
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Batch-1 decode (median inter-token)", "neighbours", "ms", sets,
                    {n: [1000 * summary[s][n]["decode_s"] for s in sets] for n in names}, kind="bar"),
        plots.Panel("Prefix-hit TTFT (median)", "neighbours", "ms", sets,
                    {n: [1000 * summary[s][n]["hit_ttft_s"] for s in sets] for n in names}, kind="bar"),
    ], "Beside neighbours that take CPU")


def describe(result: dict) -> str:
    """What the numbers say (a paragraph of docs/BENCHMARKS.md): kvtier's default against
    each other server, beside each neighbour set."""
    summary = result["summary"]
    parts = []
    for neighbour_set, by_server in summary.items():
        mine = by_server.get(KVTIER)
        if mine is None:
            continue
        for other in baseline_names(list(by_server)):
            theirs = by_server[other]
            part = (f"{neighbour_set}, against {other}: decode {mine['decode_s'] / theirs['decode_s']:.2f}x, "
                    f"hit TTFT {mine['hit_ttft_s'] / theirs['hit_ttft_s']:.2f}x")
            if "ran_s" in mine:
                part += f", CPU time run per request {mine['ran_s'] / theirs['ran_s']:.2f}x"
            parts.append(part)
    if not parts:
        return "Only one server ran: no comparison."
    text = ("kvtier with its defaults, as a ratio of each other server's median (below 1: kvtier faster): "
            + "; ".join(parts) + ".")
    if any(VLLM in by_server for by_server in summary.values()):
        text += " " + WHY_VLLM_HOLDS
    return text


# What the ran/waited table shows (docs/notes/cpu-seat-keeper.md).
WHY_VLLM_HOLDS = (
    "Where the kernel shares CPU between sessions first (autogroup; cgroups between containers), a server gets "
    "its share only while one of its threads is runnable. vLLM's worker never sleeps mid-step and its engine core "
    "and API server poll, so its session stays queued; kvtier's OpenMP team waits passively and sleeps at each "
    "of the few hundred barriers of a decode step. The seat keeper (--cpu-seat-keeper), a child process that "
    "yields the CPU while requests run, keeps kvtier's session queued too: it paid on a heavily oversubscribed "
    "host and cost decode speed beside these neighbours alone, so it is off by default.")
