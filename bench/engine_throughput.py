"""Engine vs Hugging Face transformers on the same weights, in the same process.

Every ratio is measured within the run (engine and transformers interleaved where a
part repeats), on real text (the plain-text pydoc of Python stdlib modules), with the
engine's default options and torch's default threads.

1. Prefill: a prompt of each --prefill-lens length; engine time to first token vs one
   transformers forward over the same tokens (a plain forward, every position's
   logits; and generate's prefill, the last position's only).
2. Decode at batch 1 after a --decode-context-token prompt: engine step vs transformers
   decode step (its KV cache), against the memory floor: the bytes a decode step has to
   read (every weight, and the context's KV) at the memcpy bandwidth measured here.
3. Batched decode: --batch-decode sequences of --batch-context tokens, tokens/s of both.
4. Mixed batch: --num-prompts prompts of random length and output length; continuous
   batching vs transformers generate in static batches of --hf-batch-size.
5. Stream gap: a `kvtier serve` process of the model (this process is its client) streams
   a completion while a text prompt of --big-prompt-bytes (under the 8 MiB body limit) is
   posted; the stream's longest gap between tokens while that request is in flight,
   against its median gap.
"""

from __future__ import annotations

import argparse
import gc
import http.client
import itertools
import json
import random
import threading
import time
from dataclasses import dataclass

import torch

from bench import hf_baselines, plots
from bench.common import markdown_table, median, parse_with_smoke, smoke_engine_options
from bench.profiling import profile_call, profile_note, profile_tables
from bench.server_process import ServerProcess
from bench.summary import publish, run_stamp, workload_parser
from bench.text_corpus import MODULES, CorpusTokens, module_text
from engine import LLM, SamplingParams
from engine.builtin_models import resolve_model
from engine.config import ServerConfig

NAME = "engine"
COPY_BYTES = 256 * 1024**2  # the memcpy buffer: far larger than any cache
ENGINE, HF = "engine (continuous batching)", "transformers generate (static batches)"
PARTS = ("prefill", "decode", "decode_batch", "mixed", "stream_gap")


SMOKE = {"prefill_lens": [32, 64], "repeats": 1, "decode_context": 40, "decode_steps": 3, "batch_decode": 3,
         "batch_context": 20, "num_prompts": 3, "prompt_len": [8, 24], "output_len": [2, 6], "hf_batch_size": 2,
         "big_prompt_bytes": 200_000, "stream_tokens": 24}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "the batch-1 decode and the first prefill")
    p.add_argument("--prefill-lens", type=int, nargs="+", default=(2000, 8000))
    p.add_argument("--repeats", type=int, default=3, help="Prefill repeats (interleaved engine / transformers).")
    p.add_argument("--decode-context", type=int, default=2000)
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--batch-decode", type=int, default=16)
    p.add_argument("--batch-context", type=int, default=500)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 768), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 192), metavar=("MIN", "MAX"))
    p.add_argument("--hf-batch-size", type=int, default=16, help="Static batch size of the transformers baseline.")
    p.add_argument("--big-prompt-bytes", type=int, default=8_000_000,
                   help="Size of the text prompt posted during the stream.")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS, help="The parts to run (default: all).")
    p.add_argument("--stream-tokens", type=int, default=256, help="Tokens of the streamed completion.")
    return parse_with_smoke(p, argv, SMOKE)


@dataclass
class Parts:
    """What every part measures with: the engine, transformers, and the text."""

    llm: LLM
    hf: object
    corpus: CorpusTokens
    rng: random.Random

    def prompt(self, length: int) -> list[int]:
        """`length` consecutive tokens of the corpus from a random point (prompts share no
        prefix)."""
        return self.corpus.take(self.rng, length)


def prefill(parts: Parts, length: int, repeats: int) -> dict:
    """Engine TTFT and transformers forwards over the same prompt, interleaved."""
    times: dict[str, list[float]] = {"engine": [], "hf_forward": [], "hf_last_logits": []}
    greedy_one = SamplingParams(max_tokens=1, temperature=0.0)
    for _ in range(repeats):
        prompt = parts.prompt(length)
        out = parts.llm.generate([prompt], greedy_one, use_tqdm=False)[0]
        times["engine"].append(out.metrics.time_to_first_token)
        times["hf_forward"].append(hf_baselines.forward_seconds(parts.hf, prompt))
        times["hf_last_logits"].append(hf_baselines.forward_seconds(parts.hf, prompt, logits_to_keep=1))
    result = {"prompt_len": length, **{f"{k}_s": median(v) for k, v in times.items()}, "times_s": times}
    for key in ("hf_forward", "hf_last_logits"):
        result[f"speedup_vs_{key}"] = result[f"{key}_s"] / result["engine_s"]
    return result


class EngineDecode:
    """Requests decoding on the engine, stepped one step at a time by the caller."""

    def __init__(self, llm: LLM, prompts: list[list[int]], steps: int) -> None:
        self.engine = llm.engine
        params = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
        tag = time.perf_counter_ns()
        for i, prompt in enumerate(prompts):
            self.engine.add_request(f"decode-{tag}-{i}", prompt, params)
        scheduler = self.engine.scheduler
        while scheduler.num_waiting or any(r.num_output_tokens == 0 for r in scheduler.running):
            self.engine.step()

    def step_seconds(self) -> float:
        start = time.perf_counter()
        self.engine.step()
        return time.perf_counter() - start

    def finish(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()


def interleaved_decode(llm: LLM, hf, prompts: list[list[int]], steps: int,
                       bandwidth: bool = False) -> dict[str, list[float]]:
    """Step times of the engine and of transformers decoding `prompts`, one step of each
    in turn (and a memcpy sample after each pair when `bandwidth`), so that both see
    the same load on a shared machine."""
    engine = EngineDecode(llm, prompts, steps)
    hf_steps = hf_baselines.DecodeSteps(hf, prompts)
    times: dict[str, list[float]] = {"engine": [], "hf": [], "memcpy_bytes_s": []}
    copier = _Copier() if bandwidth else None
    for _ in range(steps):
        times["engine"].append(engine.step_seconds())
        times["hf"].append(hf_steps.step_seconds())
        if copier is not None:
            times["memcpy_bytes_s"].append(copier.bytes_per_second())
    engine.finish()
    return times


class _Copier:
    """memcpy bandwidth samples: bytes per second that torch copies between two buffers
    far larger than any cache."""

    def __init__(self) -> None:
        self.src = torch.ones(COPY_BYTES, dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)

    def bytes_per_second(self) -> float:
        start = time.perf_counter()
        self.dst.copy_(self.src)
        return COPY_BYTES / (time.perf_counter() - start)


def decode_floor_bytes(llm: LLM, context: int) -> dict[str, int]:
    """What one batch-1 decode step reads at least: every weight once (the tied embedding
    is the output projection's) and the K and V of the whole context in every layer."""
    engine = llm.engine
    weights = engine.model.weight_bytes()
    kv = context * engine.block_bytes // engine.config.block_size
    return {"weights": weights, "kv": kv}


def decode_single(parts: Parts, context: int, steps: int) -> dict:
    times = interleaved_decode(parts.llm, parts.hf, [parts.prompt(context)], steps, bandwidth=True)
    engine_ms, hf_ms = 1000 * median(times["engine"]), 1000 * median(times["hf"])
    bandwidth = median(times["memcpy_bytes_s"])
    floor_bytes = decode_floor_bytes(parts.llm, context)
    floor_ms = 1000 * sum(floor_bytes.values()) / bandwidth
    return {"context": context, "engine_ms": engine_ms, "hf_ms": hf_ms, "floor_ms": floor_ms,
            "floor_bytes": floor_bytes, "memcpy_gb_s": bandwidth / 1e9,
            "engine_over_floor": engine_ms / floor_ms, "speedup_vs_hf": hf_ms / engine_ms}


def decode_batch(parts: Parts, batch: int, context: int, steps: int) -> dict:
    times = interleaved_decode(parts.llm, parts.hf, [parts.prompt(context) for _ in range(batch)], steps)
    engine_s, hf_s = median(times["engine"]), median(times["hf"])
    return {"batch": batch, "context": context, "engine_tok_s": batch / engine_s, "hf_tok_s": batch / hf_s,
            "speedup_vs_hf": hf_s / engine_s}


def mixed_batch(parts: Parts, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [parts.prompt(rng.randint(*args.prompt_len)) for _ in range(args.num_prompts)]
    outputs = [rng.randint(*args.output_len) for _ in range(args.num_prompts)]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    start = time.perf_counter()
    results = parts.llm.generate(prompts, params, use_tqdm=False)
    engine_s = time.perf_counter() - start
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    hf_s = hf_baselines.static_batches(parts.hf, prompts, outputs, args.hf_batch_size).wall_s
    return {"requests": len(prompts), "output_tokens": generated, "engine_s": engine_s, "hf_s": hf_s,
            "engine_tok_s": generated / engine_s, "hf_tok_s": sum(outputs) / hf_s, "speedup_vs_hf": hf_s / engine_s}


def stream_gap(path: str, stream_prompt: str, args: argparse.Namespace) -> dict:
    """A `kvtier serve` process of the model (this process is its client); the longest
    gap of a streamed completion while a big text prompt is posted."""
    settings = ServerConfig()
    server = ServerProcess("--model", path, "--dtype", args.dtype, "--served-model-name", "bench",
                           "--log-level", "warning", *(["--no-fuse-elementwise"] if args.smoke else []))
    # This process holds the bench's engine and transformers: a full collection of its
    # objects in the client threads would show up as gaps of the stream.
    gc.collect()
    gc.freeze()
    try:
        return _measure_gap(server.host_port, stream_prompt, _big_prompt(settings, args), args)
    finally:
        gc.unfreeze()
        server.stop()


def _big_prompt(settings, args: argparse.Namespace) -> str:
    """Real text of --big-prompt-bytes characters whose request body fits the body limit."""
    chunk = "\n".join(module_text(m) for m in MODULES)
    text = (chunk * (args.big_prompt_bytes // len(chunk) + 1))[: args.big_prompt_bytes]
    while len(json.dumps({"prompt": text})) > settings.max_request_bytes - 1024:
        text = text[: len(text) * 95 // 100]
    return text


def _measure_gap(address: tuple[str, int], stream_prompt: str, big_prompt: str, args: argparse.Namespace) -> dict:
    # Encoded before the stream starts: encoding 8 MB of JSON is the client's work, and
    # it would take this process's core from the streaming thread.
    body = json.dumps({"model": "bench", "prompt": big_prompt, "max_tokens": 4}).encode()
    events: list[float] = []
    streaming = threading.Thread(target=_stream, args=(address, stream_prompt, args.stream_tokens, events))
    streaming.start()
    while len(events) < 16 and streaming.is_alive():
        time.sleep(0.01)
    sent = time.perf_counter()
    status, answer = _post(address, body)
    answered = time.perf_counter()
    streaming.join()
    gaps = list(itertools.pairwise(events))
    during = [b - a for a, b in gaps if b >= sent and a <= answered]
    others = [b - a for a, b in gaps if b < sent or a > answered]
    code = json.loads(answer).get("error", {}).get("code") if status != 200 else None
    return {"prompt_bytes": len(big_prompt.encode()), "status": status, "error_code": code,
            "request_s": answered - sent, "longest_gap_ms": 1000 * max(during, default=0.0),
            "median_gap_ms": 1000 * median(others), "stream_tokens": len(events)}


def _stream(address: tuple[str, int], prompt: str, max_tokens: int, events: list[float]) -> None:
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "ignore_eos": True, "stream": True})
    connection = http.client.HTTPConnection(*address, timeout=600)
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    for line in response:
        if line.startswith(b"data: {"):
            events.append(time.perf_counter())
    connection.close()


def _post(address: tuple[str, int], body: bytes) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(*address, timeout=600)
    connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    answer = response.read()
    connection.close()
    return response.status, answer


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    llm = LLM(model=path, dtype=args.dtype, **smoke_engine_options(args))
    hf = hf_baselines.load_model(path, args.dtype)
    parts = Parts(llm, hf, CorpusTokens(llm.tokenizer), random.Random(args.seed))
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": path}
    llm.generate([parts.prompt(64)], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up
    if "prefill" in args.parts:
        result["prefill"] = [prefill(parts, n, args.repeats) for n in args.prefill_lens]
    if "decode" in args.parts:
        result["decode"] = decode_single(parts, args.decode_context, args.decode_steps)
    if "decode_batch" in args.parts:
        result["decode_batch"] = decode_batch(parts, args.batch_decode, args.batch_context, args.decode_steps)
    if "mixed" in args.parts:
        result["mixed"] = mixed_batch(parts, args)
    if args.profile:
        result["profile"] = profile_parts(parts, args)
    if "stream_gap" in args.parts:
        result["stream_gap"] = stream_gap(path, llm.tokenizer.decode(parts.prompt(2000)), args)
    plot(result)
    publish(NAME, result, render(result))
    return 0


def profile_parts(parts: Parts, args: argparse.Namespace) -> dict:
    """torch.profiler runs of the first prefill length and of batch-1 decode steps."""
    length = args.prefill_lens[0]
    prompt = parts.prompt(length)
    run = profile_call(lambda: parts.llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0),
                                                  use_tqdm=False))
    run.update(label=f"a {length}-token prefill", requests=1, prompt_tokens=length, output_tokens=1)
    context = parts.prompt(args.decode_context)
    steps = EngineDecode(parts.llm, [context], args.decode_steps)
    decode = profile_call(lambda: [steps.step_seconds() for _ in range(args.decode_steps)])
    steps.finish()
    decode.update(label=f"{args.decode_steps} batch-1 decode steps after {args.decode_context} tokens", requests=1,
                  prompt_tokens=args.decode_context, output_tokens=args.decode_steps)
    return {"prefill": run, "decode": decode}


def render(result: dict) -> str:
    sections = [_render_prefill, _render_decode, _render_decode_batch, _render_mixed, _render_stream_gap]
    text = "\n".join(fn(result[part]) for part, fn in zip(PARTS, sections, strict=True) if part in result)
    for part in ("prefill", "decode"):
        if "profile" in result:
            text += profile_tables({"profile": result["profile"][part]})
    return text


def _render_prefill(prefills: list[dict]) -> str:
    text = "Prefill (speedup: transformers seconds / engine seconds, median of the interleaved repeats)\n\n"
    return text + markdown_table(
        ["prompt tokens", "engine TTFT s", "transformers forward s", "speedup", "forward, last logits only s",
         "speedup"],
        [[p["prompt_len"], p["engine_s"], p["hf_forward_s"], p["speedup_vs_hf_forward"], p["hf_last_logits_s"],
          p["speedup_vs_hf_last_logits"]] for p in prefills],
    )


def _render_decode(d: dict) -> str:
    text = (f"Decode at batch 1 after {d['context']} tokens (memory floor: {d['floor_bytes']['weights'] / 1e6:.0f} MB "
            f"of weights + {d['floor_bytes']['kv'] / 1e6:.0f} MB of KV at the {d['memcpy_gb_s']:.1f} GB/s memcpy "
            "measured in this run)\n\n")
    return text + markdown_table(["system", "ms/token", "x floor"], [
        ["engine", d["engine_ms"], d["engine_over_floor"]], ["transformers", d["hf_ms"], d["hf_ms"] / d["floor_ms"]],
        ["memory floor", d["floor_ms"], 1.0]])


def _render_decode_batch(b: dict) -> str:
    text = f"Decode of {b['batch']} sequences after {b['context']} tokens each\n\n"
    return text + markdown_table(["system", "tokens/s", "speedup"], [
        ["engine", b["engine_tok_s"], b["speedup_vs_hf"]], ["transformers", b["hf_tok_s"], 1.0]])


def _render_mixed(m: dict) -> str:
    text = f"Mixed batch of {m['requests']} requests ({m['output_tokens']} output tokens)\n\n"
    return text + markdown_table(["system", "seconds", "output tok/s", "speedup"], [
        [ENGINE, m["engine_s"], m["engine_tok_s"], m["speedup_vs_hf"]], [HF, m["hf_s"], m["hf_tok_s"], 1.0]])


def _render_stream_gap(g: dict) -> str:
    text = (f"Stream gap while a {g['prompt_bytes'] / 1e6:.1f} MB text prompt is posted (answered "
            f"{g['status']} {g['error_code'] or ''} in {g['request_s']:.2f} s)\n\n")
    return text + markdown_table(["longest gap ms", "median gap ms (rest of the stream)", "stream tokens"],
                                 [[g["longest_gap_ms"], g["median_gap_ms"], g["stream_tokens"]]])


def plot(result: dict) -> None:
    panels = []
    if "prefill" in result:
        pre = result["prefill"]
        lens = [p["prompt_len"] for p in pre]
        panels.append(plots.Panel("Prefill", "prompt tokens", "tokens/s", lens, {
            "engine": [n / p["engine_s"] for n, p in zip(lens, pre, strict=True)],
            "transformers forward": [n / p["hf_forward_s"] for n, p in zip(lens, pre, strict=True)]}))
    if "decode" in result:
        d = result["decode"]
        panels.append(plots.Panel(f"Decode, batch 1, {d['context']} context", "", "ms/token",
                                  ["engine", "transformers", "memory floor"],
                                  {"ms": [d["engine_ms"], d["hf_ms"], d["floor_ms"]]}, kind="bar"))
    throughput = {f"decode x{result['decode_batch']['batch']}": result["decode_batch"]} if "decode_batch" in result else {}
    if "mixed" in result:
        throughput["mixed batch"] = result["mixed"]
    if throughput:
        panels.append(plots.Panel("Throughput", "", "tokens/s", list(throughput), {
            "engine": [t["engine_tok_s"] for t in throughput.values()],
            "transformers": [t["hf_tok_s"] for t in throughput.values()]}, kind="bar"))
    if panels:
        plots.save_figure(plots.png_path(NAME), panels, "Engine vs transformers, same weights, same process")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    text = ""
    if "prefill" in result:
        pre = ", ".join(f"{p['speedup_vs_hf_forward']:.2f}x at {p['prompt_len']} tokens "
                        f"({p['speedup_vs_hf_last_logits']:.2f}x against a forward computing the last logits only)"
                        for p in result["prefill"])
        text += f"Prefill: the engine's time to first token against one transformers forward over the same tokens: {pre}. "
    if "decode" in result:
        d = result["decode"]
        text += (f"Decode at batch 1 after {d['context']} tokens: {d['engine_ms']:.1f} ms a token, "
                 f"{d['engine_over_floor']:.2f}x the memory floor of {d['floor_ms']:.1f} ms "
                 f"({d['speedup_vs_hf']:.2f}x transformers' {d['hf_ms']:.1f} ms). ")
    if "decode_batch" in result:
        b = result["decode_batch"]
        text += (f"{b['batch']} sequences decoding: {b['engine_tok_s']:.0f} tokens/s, "
                 f"{b['speedup_vs_hf']:.2f}x transformers. ")
    if "mixed" in result:
        text += (f"The mixed batch: {result['mixed']['speedup_vs_hf']:.2f}x transformers' static batches (a static "
                 "batch decodes until its longest output with its finished rows still in it; continuous batching "
                 "gives a finished request's seat to a waiting one). ")
    if "stream_gap" in result:
        g = result["stream_gap"]
        text += (f"While a {g['prompt_bytes'] / 1e6:.1f} MB prompt was posted (answered {g['status']} in "
                 f"{g['request_s']:.2f} s), the stream's longest gap was {g['longest_gap_ms']:.0f} ms against a "
                 f"median of {g['median_gap_ms']:.0f} ms. ")
    if "profile" in result:
        text += " ".join(profile_note({"profile": result["profile"][part]}) for part in ("prefill", "decode"))
    return text.strip()
