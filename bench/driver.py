"""The request loop the engine workloads share: sessions of turns replayed on one engine.

A session is a sequence of turns, one request each. It decides when its next turn is
released (a fixed schedule, the previous answer plus a pause, or right away) and what
the prompt is (it may append the previous answer). `replay` releases due turns, steps
the engine and records per request: TTFT, latency, prompt and output tokens, prefix
tokens found in the device cache and loaded from the store, preemptions.

Also here: the engine options every workload takes, the offload variants, warm-up, and
the header (machine, versions, model, options, command) of every result file.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from bench.common import add_dtype_arg, parse_with_smoke, smoke_engine_options
from bench.console import progress
from bench.text_corpus import passage_tokens
from engine import LLM, SamplingParams
from engine.outputs import RequestOutput

WARMUP_SALT = "bench-warmup"

# Named engine variants (options on top of the workload's own); a Variant is a label and
# its options, so a workload can add its own (e.g. one per store chunk size).
VARIANTS: dict[str, dict[str, object]] = {
    "no-prefix-cache": {"enable_prefix_caching": False},
    "no-offload": {},
    "cpu": {"kv_offload": "cpu"},
    "cpu+recompute": {"kv_offload": "cpu", "preemption_mode": "recompute"},
    "disk": {"kv_offload": "disk"},
    "cpu+disk": {"kv_offload": "cpu,disk"},
}
Variant = tuple[str, dict[str, object]]


@dataclass(frozen=True)
class Turn:
    prompt: list[int]
    max_tokens: int
    tag: str = ""  # groups requests in the tables: round, phase, turn


class Session(Protocol):
    num_turns: int

    def next_turn(self, answer: list[int] | None, now: float) -> tuple[float, Turn] | None:
        """The next turn and its release time (seconds since the run started), given the
        previous answer (None before the first turn) and when it finished."""


@dataclass(frozen=True)
class Record:
    """One finished request. Hits: prompt tokens not computed by this request."""

    tag: str
    session: int
    prompt_tokens: int
    output_tokens: int
    ttft: float
    latency: float
    device_hit_tokens: int
    store_hit_tokens: int
    preemptions: int
    error: bool = False


@dataclass
class Run:
    records: list[Record]
    wall_s: float
    cpu_s: float  # this process's CPU time: the work done, whatever else shares the cores
    stats: dict[str, object] = field(default_factory=dict)  # engine counters after the run
    stats_delta: dict[str, float] = field(default_factory=dict)  # numeric counters: after - before


# ---- engine options and variants ----------------------------------------------------------


def add_engine_args(parser: argparse.ArgumentParser, num_kv_blocks: int, max_num_seqs: int = 64,
                    max_num_batched_tokens: int = 2048) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Checkpoint directory (default: the built-in model).")
    add_dtype_arg(g)
    g.add_argument("--num-kv-blocks", type=int, default=num_kv_blocks,
                   help=f"Device KV pool in 16-token blocks (default {num_kv_blocks}).")
    g.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens)
    g.add_argument("--kv-offload-cpu-size", default="4GiB")
    g.add_argument("--kv-chunk-tokens", type=int, default=256, help="Tokens per stored chunk (default 256).")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: on a shared CPU, threads that spin-wait for "
                        "each other make every op several times slower; 0 keeps torch's default).")


def parse_workload_args(parser: argparse.ArgumentParser, argv: list[str],
                        smoke_sizes: dict[str, object]) -> argparse.Namespace:
    """Parse (`--smoke` picks `smoke_sizes`); apply --threads."""
    args = parse_with_smoke(parser, argv, smoke_sizes)
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


def parse_variants(text: str) -> list[Variant]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    return [(n, VARIANTS[n]) for n in names]


def variants_help() -> str:
    return "Comma-separated, from: " + ", ".join(VARIANTS) + "."


def engine_options(args: argparse.Namespace, **overrides: object) -> dict[str, object]:
    options: dict[str, object] = {
        "model": args.model, "dtype": args.dtype, "num_kv_blocks": args.num_kv_blocks,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed, "kv_offload_cpu_size": args.kv_offload_cpu_size,
        "kv_chunk_tokens": args.kv_chunk_tokens, **smoke_engine_options(args),
    }
    options.update(overrides)
    return options


@contextlib.contextmanager
def variant_llm(args: argparse.Namespace, variant: dict[str, object], **overrides: object) -> Iterator[LLM]:
    """A warmed-up engine with the `variant` options and a fresh disk directory, so that
    no earlier run's records can hit; closed (its store shut down) on exit."""
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-") as disk:
        options = engine_options(args, **{**variant, **overrides})
        if "disk" in str(options.get("kv_offload", "")):
            options["kv_offload_disk_path"] = disk
        with LLM(**options) as llm:
            warm_up(llm)
            yield llm


def warm_up(llm: LLM) -> None:
    """One short prefill and a few decode steps, salted so that nothing is shared with the workload."""
    prompt = passage_tokens(llm.engine.tokenizer, 128, seed=-1)
    llm.generate([prompt], greedy(4), use_tqdm=False, cache_salt=WARMUP_SALT)


def engine_config(llm: LLM) -> dict[str, object]:
    """The engine's options as JSON (sizes spelled with their unit), its secret left out."""
    return llm.engine.config.model_dump(mode="json", exclude={"kv_secret"})


# ---- sampling -----------------------------------------------------------------------------


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# ---- the replay loop ----------------------------------------------------------------------


def replay(llm: LLM, sessions: Sequence[Session], desc: str) -> Run:
    """Run every session to its end on `llm`; requests are stamped with their release time,
    so time spent queued behind a running step counts in their TTFT."""
    engine = llm.engine
    before = engine.stats()
    start, cpu_start = time.monotonic(), time.process_time()
    queue: list[tuple[float, int, int, Turn]] = []
    for index, session in enumerate(sessions):
        _push(queue, index, 0, session.next_turn(None, 0.0))
    in_flight: dict[str, tuple[int, int, Turn]] = {}
    records: list[Record] = []
    with progress(total=sum(s.num_turns for s in sessions), desc=desc) as bar:
        while queue or engine.has_unfinished_requests():
            _release_due(llm, queue, in_flight, start)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, queue[0][0] - (time.monotonic() - start)))
                continue
            for out in engine.step():
                if not out.finished:
                    continue
                index, number, turn = in_flight.pop(out.request_id)
                records.append(_record(out, index, turn))
                answer = list(out.outputs[0].token_ids)
                _push(queue, index, number + 1, sessions[index].next_turn(answer, time.monotonic() - start))
                bar.update(1)
    after = engine.stats()
    return Run(records, time.monotonic() - start, time.process_time() - cpu_start, after,
               counter_delta(before, after))


def _push(queue: list, index: int, number: int, nxt: tuple[float, Turn] | None) -> None:
    if nxt is not None:
        heapq.heappush(queue, (nxt[0], index, number, nxt[1]))


def _release_due(llm: LLM, queue: list, in_flight: dict, start: float) -> None:
    now = time.monotonic() - start
    while queue and queue[0][0] <= now:
        release, index, number, turn = heapq.heappop(queue)
        request_id = f"s{index}-t{number}"
        llm.engine.add_request(request_id, turn.prompt, greedy(turn.max_tokens), arrival_time=start + release)
        in_flight[request_id] = (index, number, turn)


def _record(out: RequestOutput, session: int, turn: Turn) -> Record:
    metrics = out.metrics
    store = metrics.num_external_tokens
    ttft = metrics.time_to_first_token
    return Record(
        tag=turn.tag,
        session=session,
        prompt_tokens=len(out.prompt_token_ids),
        output_tokens=len(out.outputs[0].token_ids),
        ttft=ttft if ttft is not None else float("nan"),
        latency=(metrics.finish_time or time.monotonic()) - metrics.arrival_time,
        device_hit_tokens=max(metrics.num_cached_tokens - store, 0),
        store_hit_tokens=store,
        preemptions=metrics.num_preemptions,
        error=out.outputs[0].finish_reason in ("error", "abort"),
    )


def counter_delta(before: dict, after: dict) -> dict[str, float]:
    """after - before for every numeric counter present in both (nested dicts flattened)."""
    flat_before, flat_after = _flatten(before), _flatten(after)
    return {k: v - flat_before[k] for k, v in flat_after.items() if k in flat_before}


def _flatten(stats: dict, prefix: str = "") -> dict[str, float]:
    flat: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flatten(value, name + "."))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = value
    return flat


def merge(runs: Sequence[Run]) -> Run:
    """Repeats of one variant as one run: records pooled, times and counter deltas summed."""
    delta: dict[str, float] = {}
    for run in runs:
        for key, value in run.stats_delta.items():
            delta[key] = delta.get(key, 0) + value
    return Run([r for run in runs for r in run.records], sum(r.wall_s for r in runs), sum(r.cpu_s for r in runs),
               runs[-1].stats, delta)


def run_variants(args: argparse.Namespace, variants: Sequence[Variant],
                 make_sessions: Callable[[], Sequence[Session]], repeats: int = 1) -> dict[str, tuple[Run, dict]]:
    """Each variant on a fresh engine, variants interleaved across repeats; per variant
    label the merged run and the engine's full configuration."""
    runs: dict[str, list[Run]] = {label: [] for label, _ in variants}
    configs: dict[str, dict] = {}
    for repeat in range(repeats):
        for label, options in variants:
            with variant_llm(args, options) as llm:
                runs[label].append(replay(llm, make_sessions(), f"{label} [{repeat + 1}/{repeats}]"))
                configs[label] = engine_config(llm)
    return {label: (merge(runs[label]), configs[label]) for label in runs}
