"""Structured outputs and tool calls through `kvtier serve` and the official openai client.

Validity: --requests-per-schema requests for each of ten JSON schemas (nested objects,
enums, arrays, bounded numbers; strict, as the openai client's `parse` and agent SDKs send
them), half streamed, each checked with jsonschema; then --tool-calls calls, half to a
named function and half with tool_choice "required", each call's arguments checked against
its function's schema.

Cost, in the same run, with and without a schema, interleaved (--repeats rounds, every
other one with the schema first):
- throughput: --concurrency requests at once, each --output-len tokens (the schema's
  output is longer than that, the free one ignores EOS, so both run to the same length);
- batch-1 decode: one streamed request, the time per output token after its first chunk.
Targets (issue 47): 50 of 50 valid each; throughput with a schema >= 0.85x without;
batch-1 decode with a schema <= 1.15x without.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from bench import plots
from bench.common import add_dtype_arg, markdown_table, parse_with_smoke
from bench.server_process import ServerProcess
from bench.summary import publish, run_stamp

NAME = "structured-outputs"
SMOKE = {"model": "builtin:tiny", "requests_per_schema": 1, "tool_calls": 2, "concurrency": 2,
         "output_len": 24, "repeats": 1, "schemas": 2}
THROUGHPUT_TARGET = 0.85
DECODE_TARGET = 1.15
SERVED_NAME = "bench"


def closed(properties: dict[str, Any]) -> dict[str, Any]:
    """A strict object schema: every property required, no other."""
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


NAME_STR = {"type": "string", "maxLength": 40}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", closed({"name": NAME_STR, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a product", closed({"title": NAME_STR, "price": {"type": "number", "minimum": 0, "maximum": 10000},
                          "currency": {"enum": ["EUR", "USD", "GBP"]}})),
    ("a meeting", closed({"topic": NAME_STR, "attendees": {"type": "array", "items": NAME_STR,
                                                           "minItems": 1, "maxItems": 4}})),
    ("an address", closed({"street": NAME_STR, "city": NAME_STR,
                           "geo": closed({"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                          "lon": {"type": "number", "minimum": -180, "maximum": 180}})})),
    ("a weather report", closed({"city": NAME_STR, "celsius": {"type": "number", "minimum": -60, "maximum": 60},
                                 "sky": {"enum": ["clear", "cloudy", "rain", "snow"]}})),
    ("a book", closed({"title": NAME_STR, "author": closed({"first": NAME_STR, "last": NAME_STR}),
                       "year": {"type": "integer", "minimum": 1400, "maximum": 2030}})),
    ("a task list", closed({"tasks": {"type": "array", "maxItems": 3, "items": closed({
        "what": NAME_STR, "done": {"type": "boolean"}})}})),
    ("a rating", closed({"stars": {"type": "integer", "minimum": 1, "maximum": 5}, "comment": NAME_STR})),
    ("a flight", closed({"from": {"type": "string", "pattern": "^[A-Z]{3}$"},
                         "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                         "seats": {"type": "integer", "minimum": 1, "maximum": 9}})),
    ("an order", closed({"id": {"type": "integer", "minimum": 1, "maximum": 999999},
                         "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": closed({
                             "sku": NAME_STR, "qty": {"type": "integer", "minimum": 1, "maximum": 10}})},
                         "status": {"enum": ["new", "paid", "shipped"]}})),
]
TOOLS = [
    {"type": "function", "function": {"name": name, "description": description, "strict": True,
                                      "parameters": parameters}}
    for name, description, parameters in [
        ("get_weather", "Current weather in a city", closed({"city": NAME_STR, "unit": {"enum": ["c", "f"]}})),
        ("search_docs", "Search the documentation", closed({"query": NAME_STR,
                                                            "limit": {"type": "integer", "minimum": 1, "maximum": 20}})),
        ("book_flight", "Book a flight", SCHEMAS[8][1]),
        ("create_order", "Create an order", SCHEMAS[9][1]),
        ("send_email", "Send an email", closed({"to": NAME_STR, "subject": NAME_STR,
                                                 "urgent": {"type": "boolean"}})),
    ]
]
# The throughput schema: twelve notes, far more than --output-len tokens.
LONG_SCHEMA = closed({"notes": {"type": "array", "minItems": 12, "maxItems": 12, "items": {"type": "string",
                                                                                            "maxLength": 60}}})
COST_PROMPT = "Write notes about how a cache of computed attention keys and values saves time."


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"kvtier bench {NAME}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Model to serve (default: the built-in model).")
    add_dtype_arg(p)
    p.add_argument("--schemas", type=int, default=len(SCHEMAS), help="How many of the ten schemas.")
    p.add_argument("--requests-per-schema", type=int, default=5)
    p.add_argument("--tool-calls", type=int, default=50)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--repeats", type=int, default=4, help="Rounds of the cost runs, with and without interleaved.")
    return parse_with_smoke(p, argv, SMOKE)


def server_flags(args: argparse.Namespace) -> list[str]:
    model = ["--model", args.model] if args.model else []
    eager = ["--no-fuse-elementwise"] if args.smoke else []  # compiling the fused ops takes longer than the smoke
    return [*model, *eager, "--dtype", args.dtype, "--max-model-len", "4096", "--kv-cache-memory", "1GiB",
            "--max-num-seqs", str(max(args.concurrency, 8)), "--served-model-name", SERVED_NAME, "--log-level", "warning"]


async def schema_validity(client: Any, args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema

    rows, valid = [], 0
    for what, schema in SCHEMAS[: args.schemas]:
        ok = 0
        for i in range(args.requests_per_schema):
            kwargs = dict(messages=[{"role": "user", "content": f"Give {what} as JSON."}], max_tokens=300,
                          temperature=0.8, seed=i, model=SERVED_NAME,
                          response_format={"type": "json_schema",
                                           "json_schema": {"name": "answer", "schema": schema, "strict": True}})
            if i % 2:
                text = "".join([c.choices[0].delta.content or "" async for c in
                                await client.chat.completions.create(stream=True, **kwargs) if c.choices])
            else:
                text = (await client.chat.completions.create(**kwargs)).choices[0].message.content
            try:
                jsonschema.validate(json.loads(text), schema)
                ok += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        rows.append([what, f"{ok}/{args.requests_per_schema}"])
        valid += ok
    return {"valid": valid, "total": args.schemas * args.requests_per_schema, "rows": rows}


async def tool_validity(client: Any, args: argparse.Namespace) -> dict[str, Any]:
    import jsonschema

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    valid, failures = 0, []
    for i in range(args.tool_calls):
        tool = TOOLS[i % len(TOOLS)]["function"]
        choice = {"type": "function", "function": {"name": tool["name"]}} if i % 2 == 0 else "required"
        reply = await client.chat.completions.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": f"Please {tool['description'].lower()}."}],
            tools=TOOLS, tool_choice=choice, max_tokens=300, temperature=0.8, seed=i)
        answer = reply.choices[0]
        calls, why = answer.message.tool_calls or [], answer.finish_reason
        try:
            for call in calls:
                jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
            ok = bool(calls) and (choice == "required" or calls[0].function.name == tool["name"])
        except (ValueError, KeyError, jsonschema.ValidationError) as exc:
            ok, why = False, f"{why}, {type(exc).__name__}"
        valid += ok
        if not ok:
            failures.append(f"request {i}: finish {why}, {len(calls)} calls, "
                            f"content {(answer.message.content or '')[:80]!r}")
    return {"valid": int(valid), "total": args.tool_calls, "failures": failures}


def cost_request(args: argparse.Namespace, constrained: bool) -> dict[str, Any]:
    request: dict[str, Any] = dict(model=SERVED_NAME, messages=[{"role": "user", "content": COST_PROMPT}],
                                   max_tokens=args.output_len, temperature=0.8)
    if constrained:
        request["response_format"] = {"type": "json_schema",
                                      "json_schema": {"name": "notes", "schema": LONG_SCHEMA, "strict": True}}
    else:
        request["extra_body"] = {"ignore_eos": True}
    return request


async def throughput(client: Any, args: argparse.Namespace, constrained: bool) -> float:
    """Output tokens per second of --concurrency requests sent at once."""
    start = time.perf_counter()
    replies = await asyncio.gather(*[
        client.chat.completions.create(seed=i, **cost_request(args, constrained)) for i in range(args.concurrency)])
    elapsed = time.perf_counter() - start
    return sum(r.usage.completion_tokens for r in replies) / elapsed


async def decode_gap(client: Any, args: argparse.Namespace, constrained: bool) -> float:
    """Seconds per output token after the first streamed chunk of one request: from that
    chunk to the last, over the tokens after the first. Gaps between chunks would not be
    per token: text a grammar forces arrives several tokens to a chunk."""
    first = last = None
    tokens = 0
    async for chunk in await client.chat.completions.create(
            stream=True, seed=0, stream_options={"include_usage": True}, **cost_request(args, constrained)):
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.role is None:
            last = time.perf_counter()
            first = first or last
    if first is None or tokens < 2:
        raise RuntimeError(f"a decode-gap request streamed {tokens} tokens; --output-len must be at least 2")
    return (last - first) / (tokens - 1)


async def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    await client.chat.completions.create(**cost_request(args, True))  # warm up: compile, first touch
    schemas = await schema_validity(client, args)
    tools = await tool_validity(client, args)
    rounds = []
    for i in range(args.repeats):
        # every other round runs the schema first: neither side always meets the machine
        # as the other left it
        order = (True, False) if i % 2 else (False, True)
        measured_round = {}
        for constrained in order:
            measured_round["tok_s_schema" if constrained else "tok_s_free"] = await throughput(
                client, args, constrained)
        for constrained in order:
            measured_round["gap_schema_s" if constrained else "gap_free_s"] = await decode_gap(
                client, args, constrained)
        rounds.append(measured_round)
    await client.close()
    return {"schemas": schemas, "tools": tools, "rounds": rounds}


def summarize(measured: dict[str, Any]) -> dict[str, Any]:
    rounds = measured["rounds"]
    med = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    return {
        **med,
        "throughput_ratio": med["tok_s_schema"] / med["tok_s_free"],
        "decode_ratio": med["gap_schema_s"] / med["gap_free_s"],
    }


def render(args: argparse.Namespace, measured: dict[str, Any], summary: dict[str, Any]) -> str:
    schemas, tools = measured["schemas"], measured["tools"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "MISSED"

    lines = [
        f"Structured outputs through `kvtier serve` and the openai client (model "
        f"{args.model or 'builtin:smollm2'}, dtype {args.dtype}).", "",
        "Validity:", "",
        markdown_table(["schema", "valid"], schemas["rows"]), "",
        f"- json_schema answers that validate: **{schemas['valid']}/{schemas['total']}** "
        f"({verdict(schemas['valid'] == schemas['total'])}).",
        f"- tool calls (named and required) with schema-valid arguments: **{tools['valid']}/{tools['total']}** "
        f"({verdict(tools['valid'] == tools['total'])}).",
        *[f"  - {failure}" for failure in tools["failures"]], "",
        "Cost:", "",
        markdown_table(["", "without a schema", "with a schema", "with / without", "target"], [
            [f"throughput, {args.concurrency} requests (output tok/s)", f"{summary['tok_s_free']:.1f}",
             f"{summary['tok_s_schema']:.1f}", f"{summary['throughput_ratio']:.2f}",
             f">= {THROUGHPUT_TARGET} ({verdict(summary['throughput_ratio'] >= THROUGHPUT_TARGET)})"],
            ["batch-1 decode (ms per output token after the first)", f"{summary['gap_free_s'] * 1e3:.1f}",
             f"{summary['gap_schema_s'] * 1e3:.1f}", f"{summary['decode_ratio']:.2f}",
             f"<= {DECODE_TARGET} ({verdict(summary['decode_ratio'] <= DECODE_TARGET)})"],
        ]), "",
        f"Medians of {args.repeats} interleaved rounds; each request {args.output_len} output tokens.",
    ]
    return "\n".join(lines) + "\n"


def describe(result: dict[str, Any]) -> str:
    """What the numbers say (a paragraph of docs/BENCHMARKS.md)."""
    schemas, tools, summary = result["schemas"], result["tools"], result["summary"]
    return (f"{schemas['valid']} of {schemas['total']} answers to a JSON schema validated, and "
            f"{tools['valid']} of {tools['total']} forced tool calls had arguments valid for their function "
            f"({', '.join(tools['failures']) or 'no failure'}). With a schema, {result['options']['concurrency']} "
            f"concurrent requests produced {summary['throughput_ratio']:.2f}x the output tokens per second of the "
            f"same requests without one, and a lone request's tokens came {summary['decode_ratio']:.2f}x as far "
            "apart: the masks are built on a worker thread while the forward runs and applied in one pass.")


def plot(summary: dict[str, Any]) -> None:
    ways = ["without a schema", "with a schema"]
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Throughput", "", "output tokens/s", ways,
                    {"median": [summary["tok_s_free"], summary["tok_s_schema"]]}, kind="bar"),
        plots.Panel("Batch-1 decode", "", "ms between tokens", ways,
                    {"median": [summary["gap_free_s"] * 1e3, summary["gap_schema_s"] * 1e3]}, kind="bar"),
    ], "Structured outputs: what a JSON schema costs")


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    server = ServerProcess(*server_flags(args))
    try:
        measured = asyncio.run(measure(server.url, args))
    finally:
        server.stop()
    summary = summarize(measured)
    result = {**run_stamp(NAME, argv), "options": vars(args), **measured, "summary": summary}
    plot(summary)
    publish(NAME, result, render(args, measured, summary))
    return 0
