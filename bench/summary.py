"""What result files hold: summaries of runs, their tables, and the header of every result.

- `summarize` / `by_tag` / `run_summary`: TTFT and latency percentiles, token counts,
  prefix tokens from the device cache and from the store, per group of requests.
- `render_variants` / `describe_variants`: the per-variant, per-group table the cache
  workloads share with the engine and connector counters each variant moved (per-tier
  store hits among them), and the sentences comparing the variants.
- `workload_parser` / `checkpoint`: the options and the model of the workloads that
  build their own engines.
- `run_stamp` / `result_header` / `publish`: machine (CPU model, cores, GPU), versions,
  model, every option, the command that repeats the run, when it ran and how loaded the
  cores were.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import os
import platform
import shlex
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import (
    add_dtype_arg,
    machine_info,
    markdown_table,
    median,
    percentile,
    write_result,
)
from bench.console import echo
from bench.driver import Record, Run
from bench.profiling import profile_sentence
from engine.builtin_models import resolve_model
from engine.models import checkpoint_config


def summarize(records: Sequence[Record]) -> dict[str, float]:
    """Latency percentiles (ms) and token counts of a group of requests."""
    ttfts = [1000 * r.ttft for r in records]
    prompt = sum(r.prompt_tokens for r in records)
    device = sum(r.device_hit_tokens for r in records)
    store = sum(r.store_hit_tokens for r in records)
    return {
        "requests": len(records),
        "errors": sum(r.error for r in records),
        "ttft_p50_ms": median(ttfts),
        "ttft_p90_ms": percentile(ttfts, 90),
        "ttft_p99_ms": percentile(ttfts, 99),
        "latency_p50_ms": median([1000 * r.latency for r in records]),
        "prompt_tokens": prompt,
        "output_tokens": sum(r.output_tokens for r in records),
        "device_hit_tokens": device,
        "store_hit_tokens": store,
        "hit_fraction": (device + store) / prompt if prompt else 0.0,
        "preemptions": sum(r.preemptions for r in records),
    }


def by_tag(records: Sequence[Record]) -> dict[str, dict[str, float]]:
    tags = list(dict.fromkeys(r.tag for r in records))
    return {tag: summarize([r for r in records if r.tag == tag]) for tag in tags}


def run_summary(run: Run) -> dict[str, object]:
    """What a result file keeps of a run: per-tag and overall summaries and engine counters."""
    overall = summarize(run.records)
    overall["wall_s"] = run.wall_s
    overall["cpu_s"] = run.cpu_s
    overall["output_tok_s"] = overall["output_tokens"] / run.wall_s if run.wall_s else 0.0
    overall["output_tok_per_cpu_s"] = overall["output_tokens"] / run.cpu_s if run.cpu_s else 0.0
    return {"overall": overall, "by_tag": by_tag(run.records), "stats": run.stats,
            "stats_delta": run.stats_delta, "records": [dataclasses.asdict(r) for r in run.records]}


GAUGES = ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")


def variant_summaries(runs: dict[str, tuple[Run, dict]]) -> dict[str, dict]:
    """`run_variants` output as result content: each variant's summary and engine options."""
    return {v: {**run_summary(run), "engine_config": config} for v, (run, config) in runs.items()}


def later_summary(variant: dict, first: str) -> dict[str, float]:
    """Summary of a variant's requests outside the group `first` (the cold one)."""
    return summarize([Record(**r) for r in variant["records"] if r["tag"] != first])


# ---- tables -------------------------------------------------------------------------------


def render_variants(runs: dict[str, dict], group: str) -> str:
    """Rows of variant x group (round, phase, turn): TTFT percentiles and where the prompt
    tokens came from; then each variant's totals."""
    rows = []
    for variant, run in runs.items():
        for tag, s in run["by_tag"].items():
            rows.append([variant, tag, s["requests"], s["ttft_p50_ms"], s["ttft_p90_ms"], s["ttft_p99_ms"],
                         s["prompt_tokens"], s["device_hit_tokens"], s["store_hit_tokens"],
                         f"{100 * s['hit_fraction']:.0f}%"])
    text = markdown_table(["variant", group, "requests", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms",
                           "prompt tokens", "device hits", "store hits", "hit %"], rows)
    totals = [[v, r["overall"]["wall_s"], r["overall"]["cpu_s"], r["overall"]["ttft_p50_ms"],
               r["overall"]["preemptions"], r["overall"]["errors"]] for v, r in runs.items()]
    text += "\n" + markdown_table(["variant", "wall s", "CPU s", "TTFT p50 ms", "preemptions", "errors"], totals)
    return text + render_counters(runs)


def render_counters(runs: dict[str, dict]) -> str:
    """Engine and connector counters the variants moved during their runs, one row per
    variant (per-tier store hits are the `kv_external_hit_tokens_*` columns; the full
    per-tier store view is in the JSON)."""
    deltas = {v: {k: x for k, x in r["stats_delta"].items() if "." not in k and k not in GAUGES}
              for v, r in runs.items()}
    keys = list(dict.fromkeys(k for delta in deltas.values() for k, x in delta.items() if x))
    if not keys:
        return ""
    rows = [[variant, *(delta.get(k, 0) for k in keys)] for variant, delta in deltas.items()]
    return "\nCounters moved during each run:\n\n" + markdown_table(["variant", *keys], rows)


# ---- prose -------------------------------------------------------------------------------


def describe_variants(result: dict, first: str) -> str:
    """Sentences comparing the variants on the requests after the cold group `first`:
    TTFT, reuse and where the reused tokens came from; a note on offload runs that loaded
    nothing; the slowest path's profile."""
    variants = result["variants"]
    later = {v: later_summary(run, first) for v, run in variants.items()}
    base_name = "no-offload" if "no-offload" in later else next(iter(later))
    base = later[base_name]
    parts = [f"Beyond the cold requests ({first}), TTFT p50 is {base['ttft_p50_ms']:.0f} ms with {base_name} "
             f"({100 * base['hit_fraction']:.0f}% of prompt tokens not recomputed)"]
    for name, s in later.items():
        if name != base_name:
            parts.append(f"{s['ttft_p50_ms']:.0f} ms with {name} ({base['ttft_p50_ms'] / s['ttft_p50_ms']:.1f}x "
                         f"faster, {100 * s['hit_fraction']:.0f}%; loaded: {tier_hits(variants[name])})")
    text = "; ".join(parts) + "." + _cpu_sentence(variants, base_name)
    idle = [n for n, s in later.items() if variants[n]["engine_config"].get("kv_offload") and not s["store_hit_tokens"]]
    if idle:
        text += f" The {', '.join(idle)} run(s) loaded nothing from the store: they measure the engine without it."
    if "profile" in result:
        text += " " + profile_sentence(result["profile"])
    return text


def _cpu_sentence(variants: dict, base_name: str) -> str:
    """CPU time of the whole run: the work each variant did, a steadier figure than TTFT
    on shared cores."""
    base = variants[base_name]["overall"]["cpu_s"]
    others = [f"{n} {r['overall']['cpu_s']:.0f} s ({100 * (1 - r['overall']['cpu_s'] / base):.0f}% less)"
              for n, r in variants.items() if n != base_name]
    return f" CPU time of the whole run: {base_name} {base:.0f} s; " + ", ".join(others) + "."


def tier_hits(variant: dict) -> str:
    """Tokens loaded from the store during the run, per tier."""
    prefix = "kv_external_hit_tokens_"
    tiers = {k.removeprefix(prefix): v for k, v in variant["stats_delta"].items() if k.startswith(prefix)}
    return ", ".join(f"{tier} {int(tokens)} tokens" for tier, tokens in tiers.items()) or "nothing"


# ---- result header ------------------------------------------------------------------------


def workload_parser(name: str, doc: str | None, profiled: str) -> argparse.ArgumentParser:
    """The parser of a workload that builds its own engines, with the options they share:
    checkpoint, dtype, seed, and --no-profile (`profiled`: what the profile run covers)."""
    p = argparse.ArgumentParser(prog=f"kvtier bench {name}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint directory (default: the built-in model).")
    add_dtype_arg(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-profile", dest="profile", action="store_false",
                   help=f"Skip the torch.profiler run of {profiled}.")
    return p


def checkpoint(args: argparse.Namespace) -> tuple[str, int]:
    """The run's checkpoint directory (--model, else the built-in model) and its vocabulary size."""
    path = resolve_model(args.model)
    return path, model_info(path)["vocab_size"]


def run_stamp(workload: str, argv: Sequence[str]) -> dict[str, object]:
    """What every result file starts with: the workload, the command that repeats the run,
    when it started, how loaded the cores were, the machine and versions."""
    machine = machine_info()
    machine["cpu_model"] = cpu_model()
    machine["kvtier"] = _version("kvtier")
    return {
        "workload": workload,
        "command": shlex.join(["kvtier", "bench", workload, *argv]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "load_average_start": os.getloadavg(),
        "machine": machine,
    }


def result_header(workload: str, argv: Sequence[str], args: argparse.Namespace) -> dict[str, object]:
    """`run_stamp`, the model's shape and every option of the run."""
    model_path = resolve_model(args.model)
    return {**run_stamp(workload, argv), "model": model_info(model_path), "options": vars(args)}


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def model_info(path: str) -> dict[str, object]:
    config = checkpoint_config(path)
    keys = ("architectures", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size", "dtype", "torch_dtype")
    return {"path": path, **{k: config[k] for k in keys if k in config}}


def publish(name: str, result: dict, markdown: str) -> None:
    """Stamp the run's end (time, load average: how busy the shared cores were), write the
    JSON and Markdown results, and echo the Markdown."""
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    result["load_average_end"] = os.getloadavg()
    write_result(name, result, markdown)
    echo(markdown)
