"""What the cache workloads (multi-round QA, RAG, agent replay) share around their sessions.

`measure_variants` replays the sessions on every engine variant and summarizes the runs
(and profiles the workload's slowest path); `render_page` puts the per-variant table
under the workload's own introduction; `plot_by_group` draws TTFT and prompt tokens not
recomputed per group of requests (round, phase, turn).

A module of its own: it joins `bench.driver` (the replay) with `bench.summary` (the
result files), which itself imports `bench.driver`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from bench import plots
from bench.driver import Session, Variant, run_variants
from bench.profiling import profile_tables
from bench.summary import render_variants, result_header, variant_summaries
from bench.text_corpus import CorpusTokens


def measure_variants(name: str, argv: list[str], args: argparse.Namespace, variants: Sequence[Variant],
                     make_sessions: Callable[[CorpusTokens], Sequence[Session]],
                     profile: Callable[[argparse.Namespace, CorpusTokens], dict]) -> dict:
    """The result header, then every variant's runs (`make_sessions(corpus)` makes the
    sessions of one run from real text; variants interleaved over `args.repeats`)
    summarized under "variants", and unless --no-profile `profile(args, corpus)` under
    "profile"."""
    result = result_header(name, argv, args)
    corpus = CorpusTokens.for_model(result["model"]["path"])
    runs = run_variants(args, variants, lambda: make_sessions(corpus), args.repeats)
    result["variants"] = variant_summaries(runs)
    if args.profile:
        result["profile"] = profile(args, corpus)
    return result


def render_page(result: dict, intro: str, group: str) -> str:
    """A result page: `intro` (what ran), the variant x `group` table, the profile."""
    return intro + render_variants(result["variants"], group) + profile_tables(result)


def plot_by_group(name: str, result: dict, group: str, title: str, numbered: bool = True) -> None:
    """TTFT p50 and the share of prompt tokens not recomputed, per variant and `group`.
    `numbered` groups (round 1, round 2, ...) are drawn as lines over their number,
    others (named phases) as bars."""
    variants = result["variants"]
    tags = list(next(iter(variants.values()))["by_tag"])
    ttft = {v: [r["by_tag"][t]["ttft_p50_ms"] for t in tags] for v, r in variants.items()}
    hits = {v: [100 * r["by_tag"][t]["hit_fraction"] for t in tags] for v, r in variants.items()}
    x = list(range(1, len(tags) + 1)) if numbered else tags
    plots.save_figure(plots.png_path(name), [
        plots.Panel(f"TTFT p50 per {group}", group, "ms", x, ttft, kind="line" if numbered else "bar", logy=True),
        plots.Panel("Prompt tokens not recomputed", group, "% of prompt tokens", x, hits, kind="bar"),
    ], title)
