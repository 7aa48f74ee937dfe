"""Agent replay: sessions whose context grows by tool outputs and that pause between turns.

--agents agents share a system prompt (the tool descriptions) and each has its own task.
On every turn an agent sends its whole context, gets --answer-len tokens (the tool
call), then "runs the tool" for a pause drawn from --pause, and sends the context again
with the answer and a tool output of --tool-output tokens appended. Agents start
--stagger seconds apart. The device KV pool holds fewer contexts than there are agents:
while an agent waits for its tool, the others' prefills evict its KV, which must come
back (recomputed without offload, loaded from the store with it). The cpu+recompute
variant keeps the store but preempts by recomputation, where the pool runs out mid-turn.
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from bench.cache_workload import measure_variants, plot_by_group, render_page
from bench.driver import (
    Turn,
    add_engine_args,
    parse_variants,
    parse_workload_args,
    variant_llm,
    variants_help,
)
from bench.profiling import profile_requests
from bench.summary import describe_variants, later_summary, publish
from bench.text_corpus import CorpusTokens

NAME = "agent-replay"
SMOKE = {"agents": 3, "turns": 2, "system_prompt_len": 16, "task_len": 48, "tool_output": [8, 16],
         "answer_len": 4, "pause": [0.0, 0.05], "stagger": 0.0, "num_kv_blocks": 12,
         "kv_chunk_tokens": 16, "variants": "no-offload,cpu"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--agents", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-prompt-len", type=int, default=500)
    p.add_argument("--task-len", type=int, default=1000)
    p.add_argument("--tool-output", type=int, nargs=2, default=[200, 400], metavar=("MIN", "MAX"))
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--pause", type=float, nargs=2, default=[0.5, 2.0], metavar=("MIN", "MAX"),
                   help="Seconds a tool call takes (uniform).")
    p.add_argument("--stagger", type=float, default=1.0, help="Seconds between two agents' starts.")
    p.add_argument("--variants", default="no-offload,cpu,cpu+recompute,cpu+disk", help=variants_help())
    p.add_argument("--repeats", type=int, default=2,
                   help="Variants are interleaved across repeats (arrivals depend on timing: pool two runs).")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    add_engine_args(p, num_kv_blocks=512)
    return parse_workload_args(p, argv, SMOKE)


@dataclass
class Agent:
    """One agent: turns of (context -> tool call), then a tool output and a pause."""

    context: list[int]
    tool_outputs: list[list[int]]  # appended after turns 1 .. turns-1
    pauses: list[float]
    answer_len: int
    start: float
    done: int = field(default=0)

    @property
    def num_turns(self) -> int:
        return len(self.tool_outputs) + 1

    def next_turn(self, answer: list[int] | None, now: float) -> tuple[float, Turn] | None:
        if answer is None:
            release = self.start
        elif self.done == self.num_turns:
            return None
        else:
            self.context += answer + self.tool_outputs[self.done - 1]
            release = now + self.pauses[self.done - 1]
        self.done += 1
        return release, Turn(list(self.context), self.answer_len, f"turn {self.done}")


def make_agents(args: argparse.Namespace, corpus: CorpusTokens) -> list[Agent]:
    rng = random.Random(args.seed)
    system = corpus.take(rng, args.system_prompt_len)
    agents = []
    for a in range(args.agents):
        task = corpus.take(rng, args.task_len)
        outputs = [corpus.take(rng, rng.randint(*args.tool_output)) for _ in range(args.turns - 1)]
        pauses = [rng.uniform(*args.pause) for _ in range(args.turns - 1)]
        agents.append(Agent(system + task, outputs, pauses, args.answer_len, a * args.stagger))
    return agents


def final_context_tokens(options: dict) -> int:
    """All agents' contexts at their last turn (average tool output), the system prompt once."""
    growth = (options["turns"] - 1) * (options["answer_len"] + sum(options["tool_output"]) / 2)
    return int(options["system_prompt_len"] + options["agents"] * (options["task_len"] + growth))


def profile(args: argparse.Namespace, corpus: CorpusTokens) -> dict:
    """The slowest path: a resumed turn whose context left the device and is recomputed."""
    agent = make_agents(args, corpus)[0]
    prompt = agent.context + [t for out in agent.tool_outputs for t in out]
    with variant_llm(args, {}) as llm:
        return profile_requests(llm, [prompt], args.answer_len, "a last turn recomputed (context evicted)")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    result = measure_variants(NAME, argv, args, parse_variants(args.variants),
                              lambda corpus: make_agents(args, corpus), profile)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    o = result["options"]
    intro = (f"{o['agents']} agents x {o['turns']} turns; system prompt {o['system_prompt_len']} tokens, task "
             f"{o['task_len']}, tool outputs {o['tool_output'][0]}-{o['tool_output'][1]}, answers {o['answer_len']}, "
             f"pauses {o['pause'][0]}-{o['pause'][1]} s; device KV pool {16 * o['num_kv_blocks']} tokens for about "
             f"{final_context_tokens(o)} tokens of final contexts.\n\n")
    return render_page(result, intro, "turn")


def plot(result: dict) -> None:
    plot_by_group(NAME, result, "turn", "Agent replay: contexts evicted during tool calls")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    o = result["options"]
    variants = result["variants"]
    later = later_summary(next(iter(variants.values())), "turn 1")
    new_tokens = o["answer_len"] + sum(o["tool_output"]) / 2
    prompt = later["prompt_tokens"] / later["requests"]
    preemptions = ", ".join(f"{v} {r['overall']['preemptions']}" for v, r in variants.items())
    text = (f"{o['agents']} agents' contexts reach about {final_context_tokens(o)} tokens against a device pool of "
            f"{16 * o['num_kv_blocks']}; during a tool call of {o['pause'][0]}-{o['pause'][1]} s the other agents' "
            "turns push the waiting agent's blocks out of the device. A later turn adds its answer and a tool "
            f"output, about {new_tokens:.0f} of its {prompt:.0f} prompt tokens on average, which no cache can "
            f"spare: at most {100 * (1 - new_tokens / prompt):.0f}% is reusable. Preemptions: {preemptions} "
            "(cpu and cpu+recompute differ only when the pool runs out mid-turn). ")
    return text + describe_variants(result, first="turn 1") + _spread_sentence(variants)


def _spread_sentence(variants: dict) -> str:
    """cpu and cpu+recompute without preemptions do the same work: their gap is noise."""
    pair = [variants.get("cpu"), variants.get("cpu+recompute")]
    if None in pair or any(v["overall"]["preemptions"] for v in pair):
        return ""
    a, b = (later_summary(v, "turn 1")["ttft_p50_ms"] for v in pair)
    return (f" Without preemptions cpu and cpu+recompute do the same work, so the gap between their TTFT "
            f"({a:.0f} and {b:.0f} ms) shows the run-to-run spread of this timing-dependent workload.")
