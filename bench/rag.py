"""RAG: queries that concatenate k retrieved documents after a system prompt.

A corpus of --documents documents of real text. Each query is the system prompt, k documents
and a new question; queries go one at a time, in three phases:

- first:        --queries queries, each a random k-subset in random order;
- repeat:       the same queries again (same documents, same order, new questions);
- swap last two / reversed: the same k-subsets reordered: swapping the last two
  documents keeps the system prompt and the first k-2 documents as a prefix; reversing
  keeps only the system prompt.

Only true prefixes hit: block hashes chain every earlier token, so a document's KV can
be reused only behind the same documents in the same order. The device pool holds about
two queries, so the repeats come back from the store, whose unit is a chunk of
--kv-chunk-tokens: a hit ends at the last whole chunk before the first difference, so
the chunk size decides how much of a hit survives (one offload variant per chunk size).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from bench.cache_workload import measure_variants, plot_by_group, render_page
from bench.driver import (
    VARIANTS,
    Turn,
    Variant,
    add_engine_args,
    parse_workload_args,
    variant_llm,
)
from bench.profiling import profile_requests
from bench.summary import describe_variants, publish
from bench.text_corpus import CorpusTokens

NAME = "rag"
FIRST = "first"
SMOKE = {"documents": 4, "doc_len": 40, "k": 3, "queries": 4, "system_prompt_len": 16, "question_len": 4,
         "answer_len": 2, "chunk_tokens": [16, 32], "num_kv_blocks": 12}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=12)
    p.add_argument("--doc-len", type=int, default=600)
    p.add_argument("-k", type=int, default=3, help="Documents per query (at least 3).")
    p.add_argument("--queries", type=int, default=8, help="Queries per phase.")
    p.add_argument("--system-prompt-len", type=int, default=100)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--answer-len", type=int, default=16)
    p.add_argument("--chunk-tokens", type=int, nargs="+", default=[64, 256, 1024],
                   help="Store chunk sizes (--kv-chunk-tokens), one cpu-offload variant each.")
    p.add_argument("--repeats", type=int, default=1, help="Variants are interleaved across repeats.")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    add_engine_args(p, num_kv_blocks=256)
    return parse_workload_args(p, argv, SMOKE)


def variants(args: argparse.Namespace) -> list[Variant]:
    chunked = [(f"cpu, chunk {c}", {**VARIANTS["cpu"], "kv_chunk_tokens": c}) for c in args.chunk_tokens]
    return [("no-offload", VARIANTS["no-offload"]), *chunked]


@dataclass
class QueryStream:
    """One client sending its queries one after another."""

    queries: list[tuple[str, list[int]]]
    answer_len: int
    sent: int = field(default=0)

    @property
    def num_turns(self) -> int:
        return len(self.queries)

    def next_turn(self, answer: list[int] | None, now: float) -> tuple[float, Turn] | None:
        if self.sent == len(self.queries):
            return None
        tag, prompt = self.queries[self.sent]
        self.sent += 1
        return now, Turn(prompt, self.answer_len, tag)


def make_queries(args: argparse.Namespace, corpus: CorpusTokens) -> list[tuple[str, list[int]]]:
    rng = random.Random(args.seed)
    system = corpus.take(rng, args.system_prompt_len)
    docs = [corpus.take(rng, args.doc_len) for _ in range(args.documents)]
    picks = [rng.sample(range(args.documents), args.k) for _ in range(args.queries)]
    orders = [(FIRST, p) for p in picks] + [("repeat", p) for p in picks]
    for i, p in enumerate(picks):
        orders.append(("swap last two", [*p[:-2], p[-1], p[-2]]) if i % 2 else ("reversed", p[::-1]))

    def prompt(picked: list[int]) -> list[int]:
        return system + [t for d in picked for t in docs[d]] + corpus.take(rng, args.question_len)

    return [(tag, prompt(picked)) for tag, picked in orders]


def profile(args: argparse.Namespace, corpus: CorpusTokens) -> dict:
    """The slowest path: a query none of whose documents is found (a full prefill)."""
    _, prompt = make_queries(args, corpus)[0]
    with variant_llm(args, VARIANTS["no-offload"]) as llm:
        return profile_requests(llm, [prompt], args.answer_len, "a query with nothing cached")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    if args.k < 3:
        raise SystemExit("-k must be at least 3 (the reordered phase swaps the last two documents)")
    result = measure_variants(NAME, argv, args, variants(args),
                              lambda corpus: [QueryStream(make_queries(args, corpus), args.answer_len)], profile)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    o = result["options"]
    shared = o["system_prompt_len"] + o["k"] * o["doc_len"]
    intro = (f"{o['documents']} documents of {o['doc_len']} tokens, {o['k']} per query after a "
             f"{o['system_prompt_len']}-token system prompt ({shared} shared tokens + a {o['question_len']}-token "
             f"question), {o['queries']} queries per phase, one at a time; device KV pool "
             f"{16 * o['num_kv_blocks']} tokens.\n\n")
    return render_page(result, intro, "phase")


def plot(result: dict) -> None:
    plot_by_group(NAME, result, "phase", "RAG: k documents per query, only true prefixes hit", numbered=False)


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    o = result["options"]
    shared = o["system_prompt_len"] + o["k"] * o["doc_len"]
    swapped = o["system_prompt_len"] + (o["k"] - 2) * o["doc_len"]
    lines = []
    for label, run in result["variants"].items():
        repeat, swap = run["by_tag"]["repeat"], run["by_tag"]["swap last two"]
        lines.append(f"{label} {100 * repeat['hit_fraction']:.0f}% and {100 * swap['hit_fraction']:.0f}%")
    text = (f"A repeated query has the same first {shared} tokens as its first run, a query with its last two "
            f"documents swapped only the first {swapped}, a reversed one only the {o['system_prompt_len']}-token "
            "system prompt: block hashes chain every earlier token, so a document's KV is reused only behind the "
            "same documents in the same order. Prompt tokens not recomputed, repeats and swapped queries: "
            + "; ".join(lines) + ". The device pool keeps only the last couple of queries, so the repeats come "
            "back from the store, which rounds each hit down to whole chunks: the larger the chunk, the more of "
            "a hit is lost (up to a whole chunk per query). ")
    return text + describe_variants(result, first=FIRST)
