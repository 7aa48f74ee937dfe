"""Agents in a real tool loop against `kvtier serve`, with the cache on and off.

The agent-replay workload's shape, driven as agent frameworks drive a server: through
the official `openai` client's tool loop. --agents agents share a system prompt (the
tools' descriptions follow it, rendered by the server) and each has its own task. On
every turn an agent sends its whole history with `tools` and tool_choice="required"
(the server's grammar makes even a small model answer a valid call), reads the call
from the streamed deltas, and appends it as an assistant message with `tool_calls` and
a `tool` message answering it: a tool output of --tool-output tokens of real text. The
agents take their turns round-robin, one request at a time, so each turn extends the
agent's previous prompt while the other agents' turns ran in between, and TTFT measures
the work of the turn, not a queue.

The default shape is a long-running agent: a long system prompt and tool list (~1,500
tokens at turn 1) and short steps (a call and a 100-140-token tool output each), over 31
turns. It is the shape the targets need: a turn's new tokens must be at most a tenth of
its prompt from turn 3 on, and over the turns that can hit the cache (turn 2 on; turn 1
is the agent's first request, cold by definition, and is reported beside them) TTFT must
stay flat while the history grows 4x.

Two servers of the same model run one after the other: "cache on" (prefix caching and
a small cpu offload tier) and "cache off" (--no-enable-prefix-caching, no offload). Per
turn: TTFT (request sent to the first streamed piece of the call, which carries its
name; the grammar's fixed text before it takes a few decode steps), prompt
tokens and the cached ones (`usage.prompt_tokens_details.cached_tokens`). A turn can
reuse at most what the server saw before (the previous turn's prompt and call): the
rest, the call as rendered and the new tool output, is new, so the cached share of a
turn is bounded by 1 - new/prompt; the tables give that bound next to the share.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import openai

from bench import plots
from bench.common import add_dtype_arg, markdown_table, median, parse_with_smoke
from bench.console import echo
from bench.server_process import ServerProcess
from bench.summary import publish, result_header
from bench.text_corpus import CorpusTokens
from engine.builtin_models import resolve_model
from engine.models import load_tokenizer

NAME = "agent-tools"
SERVED_NAME = "bench"
VARIANTS = {
    "cache on": ("--enable-prefix-caching", "--kv-offload", "cpu"),
    "cache off": ("--no-enable-prefix-caching",),
}
# The targets of issue 47, item 3.
CACHED_FROM_TURN, CACHED_SHARE = 3, 0.90
TTFT_SPREAD, HISTORY_GROWTH = 1.5, 4.0
WARM_FROM_TURN = 2  # the first turn with an earlier request of the agent's to hit
SMOKE = {"agents": 2, "turns": 2, "system_prompt_len": 16, "task_len": 16, "tool_output": [16, 24],
         "max_tokens": 160, "max_model_len": 2048, "server_args": "--no-fuse-elementwise"}

# Bounded arguments (enums, integer ranges, short strings): a forced call always closes
# within --max-tokens, whatever the model.
TOOLS = [
    {"type": "function", "function": {
        "name": "search_docs", "description": "Search the Python standard library documentation.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "maxLength": 32, "description": "Words to search for"},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
            "required": ["query", "max_results"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "read_section", "description": "Read one section of a module's documentation page.",
        "parameters": {"type": "object", "properties": {
            "module": {"enum": ["json", "argparse", "pathlib", "asyncio", "logging", "re", "typing"]},
            "section": {"enum": ["DESCRIPTION", "CLASSES", "FUNCTIONS", "DATA"]}},
            "required": ["module", "section"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "run_python", "description": "Run a short Python snippet and return what it prints.",
        "parameters": {"type": "object", "properties": {
            "code": {"type": "string", "maxLength": 48}},
            "required": ["code"], "additionalProperties": False}}},
]
TOOL_NAMES = {tool["function"]["name"] for tool in TOOLS}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:smollm2", help="What `kvtier serve --model` serves.")
    add_dtype_arg(p)
    p.add_argument("--agents", type=int, default=2)
    p.add_argument("--turns", type=int, default=31)
    p.add_argument("--system-prompt-len", type=int, default=900,
                   help="Tokens of the shared system prompt, before the tools' descriptions.")
    p.add_argument("--task-len", type=int, default=200, help="Tokens of each agent's task.")
    p.add_argument("--tool-output", type=int, nargs=2, default=[100, 140], metavar=("MIN", "MAX"),
                   help="Tokens of a tool output (uniform).")
    p.add_argument("--max-tokens", type=int, default=96, help="max_tokens of a turn (its tool call).")
    p.add_argument("--max-model-len", type=int, default=None, help="The servers' --max-model-len.")
    p.add_argument("--kv-offload-cpu-size", default="1GiB", help="The cpu tier of the cache-on server.")
    p.add_argument("--server-args", default="", help="More `kvtier serve` flags for both servers (one string).")
    p.add_argument("--seed", type=int, default=0)
    return parse_with_smoke(p, argv, SMOKE)


# ---- the agents -----------------------------------------------------------------------------


@dataclass
class Agent:
    """One agent's history (OpenAI messages) and the tool outputs it will be answered with."""

    index: int
    messages: list[dict]
    tool_outputs: list[str]  # the answers to the calls of turns 1 .. turns-1

    def add_call(self, call: dict, turn: int) -> None:
        """The turn's call and, unless it was the last turn, the tool's answer to it."""
        self.messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        if turn <= len(self.tool_outputs):
            self.messages.append({"role": "tool", "tool_call_id": call["id"], "content": self.tool_outputs[turn - 1]})


def make_agents(args: argparse.Namespace, corpus: CorpusTokens, tokenizer: Any) -> list[Agent]:
    """Texts decoded from runs of corpus tokens, so that their sizes are about the
    requested token counts (the server's tokenization of the rendered history decides)."""
    rng = random.Random(args.seed)

    def text(n: int) -> str:
        return tokenizer.decode(corpus.take(rng, n))

    system = "You are a research agent. Use the tools to answer the task.\n" + text(args.system_prompt_len)
    agents = []
    for a in range(args.agents):
        task = text(args.task_len)
        outputs = [text(rng.randint(*args.tool_output)) for _ in range(args.turns - 1)]
        agents.append(Agent(a, [{"role": "system", "content": system}, {"role": "user", "content": task}], outputs))
    return agents


@dataclass
class TurnRecord:
    """What one request of the loop measured and the call it returned."""

    agent: int
    turn: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    finish_reason: str | None
    tool: str
    arguments: str
    problems: list[str] = field(default_factory=list)


def take_turn(client: openai.OpenAI, agent: Agent, turn: int, max_tokens: int) -> TurnRecord:
    """One request of the tool loop, streamed; the call it made is added to the history.
    What does not hold of a forced call (one complete call, a known tool, JSON
    arguments, finish reason tool_calls, usage with cached tokens) is kept in `problems`."""
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=SERVED_NAME, messages=agent.messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
        stream=True, stream_options={"include_usage": True}, temperature=0, max_tokens=max_tokens)
    first_token = None
    calls: dict[int, dict] = {}
    finish = usage = None
    for i, chunk in enumerate(stream):
        if chunk.usage is not None:
            usage = chunk.usage
        if i > 0 and first_token is None:  # chunk 0 is the role head, sent before any token
            first_token = time.perf_counter()
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function:
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    end = time.perf_counter()
    problems = []
    if len(calls) != 1:
        problems.append(f"{len(calls)} calls")
    call = calls.get(0, {"id": "", "name": "", "arguments": ""})
    if call["name"] not in TOOL_NAMES:
        problems.append(f"unknown tool {call['name']!r}")
    try:
        json.loads(call["arguments"])
    except ValueError:
        problems.append(f"arguments not JSON: {call['arguments']!r}")
    if finish != "tool_calls":
        problems.append(f"finish_reason {finish!r}")
    details = usage.prompt_tokens_details if usage else None
    if usage is None or details is None or details.cached_tokens is None:
        problems.append("no usage.prompt_tokens_details.cached_tokens")
    agent.add_call({"id": call["id"], "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]}}, turn)
    return TurnRecord(agent.index, turn, (first_token or end) - start, end - start,
                      usage.prompt_tokens if usage else 0, (details.cached_tokens or 0) if details else 0,
                      usage.completion_tokens if usage else 0, finish, call["name"], call["arguments"], problems)


def run_variant(args: argparse.Namespace, variant: str, agents: list[Agent]) -> dict:
    """Start the variant's server, warm it up (its first request compiles the tools'
    grammar and sizes the first batch; its prompt shares no prefix with the agents'),
    run every agent's turns round-robin, stop it."""
    flags = ["--model", args.model, "--dtype", args.dtype, "--served-model-name", SERVED_NAME,
             "--log-level", "warning", *VARIANTS[variant], *shlex.split(args.server_args)]
    if "--kv-offload" in flags:
        flags += ["--kv-offload-cpu-size", args.kv_offload_cpu_size]
    if args.max_model_len:
        flags += ["--max-model-len", str(args.max_model_len)]
    server = ServerProcess(*flags)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=600)
        take_turn(client, Agent(-1, [{"role": "user", "content": "Warm up."}], []), 1, args.max_tokens)
        records = []
        for turn in range(1, args.turns + 1):
            for agent in agents:
                records.append(take_turn(client, agent, turn, args.max_tokens))
                echo(f"{variant}: agent {agent.index} turn {turn}: {records[-1].prompt_tokens} prompt tokens, "
                     f"{records[-1].cached_tokens} cached, TTFT {1000 * records[-1].ttft_s:.0f} ms")
    except openai.APIConnectionError:
        echo(f"{variant}: the server is gone (exit code {server.process.poll()}); its output:\n{server.output}")
        raise
    finally:
        server.stop()
    return {"server_flags": flags, "records": [asdict(r) for r in records]}


# ---- per-turn summaries and the targets -------------------------------------------------


def per_turn(records: list[dict]) -> list[dict]:
    """Per turn, medians over agents: prompt tokens, cached share, TTFT."""
    turns = sorted({r["turn"] for r in records})
    rows = []
    for turn in turns:
        group = [r for r in records if r["turn"] == turn]
        rows.append({"turn": turn,
                     "prompt_tokens": median([r["prompt_tokens"] for r in group]),
                     "cached_tokens": median([r["cached_tokens"] for r in group]),
                     "cached_share": median([r["cached_tokens"] / max(r["prompt_tokens"], 1) for r in group]),
                     "ttft_ms": median([1000 * r["ttft_s"] for r in group])})
    return rows


def reusable_share(records: list[dict]) -> dict[int, float]:
    """Per turn, the median over agents of the share of the prompt an earlier request of
    the same agent held (its previous prompt and answer): the most a prefix cache can serve
    of it, short of the other agents' shared prefix at turn 1."""
    by_agent = {(r["agent"], r["turn"]): r for r in records}
    shares: dict[int, list[float]] = {}
    for (agent, turn), r in by_agent.items():
        before = by_agent.get((agent, turn - 1))
        if before:
            seen = before["prompt_tokens"] + before["completion_tokens"]
            shares.setdefault(turn, []).append(min(1.0, seen / r["prompt_tokens"]))
    return {turn: median(values) for turn, values in shares.items()}


def check_targets(on: list[dict], reusable: dict[int, float]) -> dict:
    """Issue 47's targets on the cache-on turns, with the reusable share next to the cached
    one: a turn's new tokens (its call and tool output) bound what any cache can serve."""
    later = [t["cached_share"] for t in on if t["turn"] >= CACHED_FROM_TURN]
    warm = [t for t in on if t["turn"] >= WARM_FROM_TURN] or on
    ttfts = [t["ttft_ms"] for t in warm]
    growth = warm[-1]["prompt_tokens"] / warm[0]["prompt_tokens"]
    spread = max(ttfts) / min(ttfts)
    return {
        "min_cached_share_from_turn_3": min(later, default=float("nan")),
        "min_reusable_share_from_turn_3": min((v for k, v in reusable.items() if k >= CACHED_FROM_TURN),
                                              default=float("nan")),
        "cached_share_met": bool(later) and min(later) >= CACHED_SHARE,
        "history_growth": growth,
        "ttft_spread": spread,
        "ttft_flat_met": spread <= TTFT_SPREAD and growth >= HISTORY_GROWTH,
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    result = result_header(NAME, argv, args)
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    corpus = CorpusTokens(tokenizer)
    result["variants"] = {}
    for variant in VARIANTS:
        run = run_variant(args, variant, make_agents(args, corpus, tokenizer))
        run["turns"] = per_turn(run["records"])
        result["variants"][variant] = run
    on = result["variants"]["cache on"]
    result["reusable_share"] = reusable_share(on["records"])
    result["targets"] = check_targets(on["turns"], result["reusable_share"])
    result["problems"] = [f"{v}: agent {r['agent']} turn {r['turn']}: {'; '.join(r['problems'])}"
                          for v, run in result["variants"].items() for r in run["records"] if r["problems"]]
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def render(result: dict) -> str:
    o = result["options"]
    on, off = (result["variants"][v]["turns"] for v in VARIANTS)
    reusable = {int(k): v for k, v in result["reusable_share"].items()}
    text = (f"{o['agents']} agents x {o['turns']} turns through the openai client's tool loop (tool_choice "
            f"required, streamed); system prompt {o['system_prompt_len']} tokens plus {len(TOOLS)} tools' "
            f"descriptions, task {o['task_len']}, tool outputs {o['tool_output'][0]}-{o['tool_output'][1]} tokens; "
            "agents round-robin, one request at a time. Per turn, medians over agents; reusable: the share of the "
            "prompt the agent's previous request held (prompt and call), the most a prefix cache can serve.\n\n")
    rows = [[a["turn"], round(a["prompt_tokens"]), f"{100 * a['cached_share']:.0f}%",
             f"{100 * reusable[a['turn']]:.0f}%" if a["turn"] in reusable else "-",
             f"{100 * b['cached_share']:.0f}%", a["ttft_ms"], b["ttft_ms"], a["ttft_ms"] / b["ttft_ms"]]
            for a, b in zip(on, off, strict=True)]
    text += markdown_table(["turn", "prompt tokens", "cached (on)", "reusable", "cached (off)", "TTFT on ms",
                            "TTFT off ms", "TTFT on/off"], rows)
    t = result["targets"]
    text += (f"\nTargets (cache on): cached share >= {CACHED_SHARE:.0%} from turn {CACHED_FROM_TURN} on: "
             f"{'PASS' if t['cached_share_met'] else 'MISS'} (lowest {t['min_cached_share_from_turn_3']:.1%}, "
             f"the reusable share there {t['min_reusable_share_from_turn_3']:.1%}); "
             f"TTFT max/min across turns {WARM_FROM_TURN}-{on[-1]['turn']} <= {TTFT_SPREAD} while the prompt "
             f"grows >= {HISTORY_GROWTH:.0f}x over them: "
             f"{'PASS' if t['ttft_flat_met'] else 'MISS'} ({t['ttft_spread']:.2f}x, prompt "
             f"{t['history_growth']:.1f}x).\n")
    if result["problems"]:
        text += "\nTool-call problems:\n\n" + "\n".join(f"- {p}" for p in result["problems"]) + "\n"
    return text


def plot(result: dict) -> None:
    turns = {v: run["turns"] for v, run in result["variants"].items()}
    x = [t["turn"] for t in turns["cache on"]]
    tokens = {"prompt": [t["prompt_tokens"] for t in turns["cache on"]],
              "cached (on)": [t["cached_tokens"] for t in turns["cache on"]]}
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Time to first token (median over agents)", "turn", "ms", x,
                    {v: [t["ttft_ms"] for t in rows] for v, rows in turns.items()}),
        plots.Panel("Prompt tokens and cached tokens", "turn", "tokens", x, tokens),
    ], "Agents in a tool loop against kvtier serve")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    on, off = (result["variants"][v]["turns"] for v in VARIANTS)
    t = result["targets"]
    last_on, last_off = on[-1], off[-1]
    off_spread = max(r["ttft_ms"] for r in off) / min(r["ttft_ms"] for r in off)
    warm = next((r for r in on if r["turn"] >= WARM_FROM_TURN), on[0])
    return (f"From turn {warm['turn']} on the history grows {t['history_growth']:.1f}x, from "
            f"{warm['prompt_tokens']:.0f} to "
            f"{last_on['prompt_tokens']:.0f} prompt tokens. With the cache on, the last turn's TTFT is "
            f"{last_on['ttft_ms']:.0f} ms against {last_off['ttft_ms']:.0f} ms without "
            f"({last_off['ttft_ms'] / last_on['ttft_ms']:.1f}x faster); across turns {WARM_FROM_TURN} on the "
            f"cache-on TTFT varies {t['ttft_spread']:.2f}x (turn 1, cold: {on[0]['ttft_ms']:.0f} ms), the cache-off "
            f"one {off_spread:.2f}x over all turns. From turn {CACHED_FROM_TURN} on, at "
            f"least {t['min_cached_share_from_turn_3']:.0%} of each prompt came from the cache, where the agent's "
            f"earlier requests held at least {t['min_reusable_share_from_turn_3']:.0%} of it: the rest is the call "
            "as the template renders it and the new tool output, which no cache has seen. "
            + history_cost(on))


def history_cost(on: list[dict]) -> str:
    """Why a warm turn's TTFT grows with the history: a least-squares line of TTFT against
    prompt tokens over the warm turns. The slope is the new tokens' attention over the
    history (exact attention reads every earlier key), which no cache removes."""
    warm = [t for t in on if t["turn"] >= WARM_FROM_TURN]
    if len(warm) < 3:
        return ""
    xs, ys = [t["prompt_tokens"] for t in warm], [t["ttft_ms"] for t in warm]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread_x = sum((x - mean_x) ** 2 for x in xs)
    if spread_x == 0:
        return ""
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / spread_x
    base = mean_y - slope * mean_x
    first, last = base + slope * xs[0], base + slope * xs[-1]
    return (f"A line through the warm turns' TTFT gives {base:.0f} ms plus {1000 * slope:.0f} ms per 1,000 "
            "tokens of history, mostly the new tokens' attention over every earlier token (rendering and tokenizing the "
            "longer history cost milliseconds), which grows with the "
            f"history whatever is cached, so the line alone goes from {first:.0f} to {last:.0f} ms "
            f"({last / first:.2f}x) over these turns.")
