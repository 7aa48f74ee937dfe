"""Multi-round QA: users chatting over a shared system prompt, their histories growing.

LMCache's multi-round QA shape (there: 10 users, 5 rounds, a 1,000-token system prompt,
2,000-token per-user history, 100-token answers). Each user's round-r prompt is the
system prompt, the user's own history, every earlier question with the engine's actual
answer, and a new question. Rounds go out at --qps overall, users in turn (user u's
round r is due at (r * users + u) / qps), but never before the user's previous answer
is back. The device KV pool (--num-kv-blocks) is smaller than all users' contexts
together, so while the others take their turns a user's history leaves the device:
without offload its next round recomputes it; with offload it is loaded from the store.
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
from bench.summary import describe_variants, publish
from bench.text_corpus import CorpusTokens

NAME = "multi-round-qa"
SMOKE = {"users": 4, "rounds": 2, "system_prompt_len": 32, "history_len": 48, "question_len": 8,
         "answer_len": 4, "qps": 50.0, "num_kv_blocks": 12, "kv_chunk_tokens": 16,
         "variants": "no-offload,cpu"}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=6)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-prompt-len", type=int, default=1000)
    p.add_argument("--history-len", type=int, default=2000)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=64)
    p.add_argument("--qps", type=float, default=0.25,
                   help="Rounds sent per second over all users (default 0.25: a cold round fits in the gap on "
                        "this CPU, so TTFT measures the work, not a backlog).")
    p.add_argument("--variants", default="no-offload,cpu,cpu+disk", help=variants_help())
    p.add_argument("--repeats", type=int, default=1, help="Variants are interleaved across repeats.")
    p.add_argument("--no-profile", dest="profile", action="store_false")
    add_engine_args(p, num_kv_blocks=512)
    return parse_workload_args(p, argv, SMOKE)


@dataclass
class User:
    """One user's conversation: the context grows by each question and its answer."""

    index: int
    context: list[int]
    questions: list[list[int]]
    answer_len: int
    period: float  # seconds between two rounds of the same user at the target QPS
    offset: float  # this user's first slot
    asked: int = field(default=0)

    @property
    def num_turns(self) -> int:
        return len(self.questions)

    def next_turn(self, answer: list[int] | None, now: float) -> tuple[float, Turn] | None:
        if answer is not None:
            self.context += answer
        if self.asked == len(self.questions):
            return None
        self.context += self.questions[self.asked]
        due = self.offset + self.asked * self.period
        self.asked += 1
        return max(due, now), Turn(list(self.context), self.answer_len, f"round {self.asked}")


def make_users(args: argparse.Namespace, corpus: CorpusTokens) -> list[User]:
    rng = random.Random(args.seed)
    system = corpus.take(rng, args.system_prompt_len)
    users = []
    for u in range(args.users):
        history = corpus.take(rng, args.history_len)
        questions = [corpus.take(rng, args.question_len) for _ in range(args.rounds)]
        users.append(User(u, system + history, questions, args.answer_len, args.users / args.qps, u / args.qps))
    return users


def profile(args: argparse.Namespace, corpus: CorpusTokens) -> dict:
    """The slowest path: a round whose context has left the device and is recomputed."""
    user = make_users(args, corpus)[0]
    with variant_llm(args, {}) as llm:
        return profile_requests(llm, [user.context + user.questions[0]], args.answer_len,
                                "one round recomputed (history not cached)")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    result = measure_variants(NAME, argv, args, parse_variants(args.variants),
                              lambda corpus: make_users(args, corpus), profile)
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def context_tokens(options: dict) -> int:
    """All users' contexts at the last round, the shared system prompt once."""
    per_user = options["history_len"] + options["rounds"] * (options["question_len"] + options["answer_len"])
    return options["system_prompt_len"] + options["users"] * per_user


def render(result: dict) -> str:
    o = result["options"]
    intro = (f"{o['users']} users x {o['rounds']} rounds, system prompt {o['system_prompt_len']} tokens, history "
             f"{o['history_len']}, questions {o['question_len']}, answers {o['answer_len']}, {o['qps']} QPS; device "
             f"KV pool {16 * o['num_kv_blocks']} tokens for {context_tokens(o)} tokens of contexts.\n\n")
    return render_page(result, intro, "round")


def plot(result: dict) -> None:
    plot_by_group(NAME, result, "round", "Multi-round QA")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    o = result["options"]
    text = (f"The {o['users']} users' contexts grow to {context_tokens(o)} tokens against a device pool of "
            f"{16 * o['num_kv_blocks']}: while the other users take their turns, a user's history is evicted "
            "(LRU), and only the shared system prompt stays on the device. ")
    if "profile" in result:
        prof = result["profile"]
        recompute_s, interval_s = prof["wall_ms"] / 1000, 1 / o["qps"]
        text += (f"At {o['qps']} QPS a round arrives every {interval_s:.1f} s, and recomputing a "
                 f"{prof['prompt_tokens']}-token context took {recompute_s:.1f} s in the profile run")
        text += (": without offload the rounds queue behind each other and their TTFT includes that wait. "
                 if recompute_s > interval_s else ", within the gap between rounds. ")
    return text + describe_variants(result, first="round 1")
