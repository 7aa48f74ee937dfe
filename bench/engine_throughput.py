"""Engine vs Hugging Face transformers on the same weights, in the same process.

1. Mixed batch: N prompts of random length and output length, no shared prefixes. Our
   engine (continuous batching) vs `generate` with static batches of the same size.
2. Prefill: one long prompt, our time to first token vs one transformers forward.
3. Decode: ms per engine step at batch 1 and batch 32.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoModelForCausalLM

from bench import plots
from bench.common import markdown_table, median, timed
from bench.profiling import profile_note, profile_requests, profile_tables
from bench.summary import publish, run_stamp, workload_parser
from engine import LLM, SamplingParams
from engine.builtin_models import resolve_model

NAME = "engine"
PROFILE_PROMPTS = 8  # the profile runs this many of the mixed batch's requests together
ENGINE, HF = "engine (continuous batching)", "transformers generate (static batches)"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, f"{PROFILE_PROMPTS} requests of the mixed batch")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--batch-size", type=int, default=64, help="Engine max_num_seqs and HF static batch size.")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--decode-batches", type=int, nargs="+", default=(1, 32))
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--skip-hf-batch", action="store_true", help="Skip the (slow) transformers batch baseline.")
    return p.parse_args(argv)


def make_workload(args: argparse.Namespace, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.num_prompts)]
    outputs = [rng.randint(*args.output_len) for _ in range(args.num_prompts)]
    return prompts, outputs


def engine_batch(llm: LLM, prompts: list[list[int]], outputs: list[int]) -> dict:
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in outputs]
    seconds, results = timed(lambda: llm.generate(prompts, params, use_tqdm=False))
    generated = sum(len(r.outputs[0].token_ids) for r in results)
    return {"seconds": seconds, "output_tokens": generated, "output_tok_s": generated / seconds}


def hf_static_batches(model, prompts: list[list[int]], outputs: list[int], batch_size: int) -> dict:
    """transformers generate, left-padded static batches; only requested tokens count."""
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch, lens = prompts[i : i + batch_size], outputs[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(lens), min_new_tokens=max(lens),
                           do_sample=False, pad_token_id=0)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": sum(outputs), "output_tok_s": sum(outputs) / seconds}


def prefill(llm: LLM, model, length: int, vocab: int, repeats: int = 3) -> dict:
    rng = random.Random(1)
    ours, theirs = [], []
    for _ in range(repeats):
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)[0]
        ours.append(out.metrics.time_to_first_token)
        with torch.inference_mode():
            theirs.append(timed(lambda p=prompt: model(torch.tensor([p]), use_cache=False))[0])
    return {"prompt_len": length, "engine_s": median(ours), "hf_forward_s": median(theirs),
            "engine_tok_s": length / median(ours), "hf_tok_s": length / median(theirs)}


def decode_step_ms(llm: LLM, batch: int, steps: int, vocab: int) -> float:
    """Median wall time of an engine step once `batch` requests are all decoding."""
    engine = llm.engine
    rng = random.Random(2)
    params = SamplingParams(max_tokens=steps + 4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"decode-{batch}-{i}", [rng.randrange(3, vocab) for _ in range(128)], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.running) or engine.scheduler.num_waiting:
        engine.step()
    times = [timed(engine.step)[0] for _ in range(steps)]
    while engine.has_unfinished_requests():
        engine.step()
    return 1000 * median(times)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    llm = LLM(model=path, dtype=args.dtype, max_num_seqs=args.batch_size,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    vocab = llm.engine.spec.vocab_size
    prompts, outputs = make_workload(args, vocab)
    result = {**run_stamp(NAME, argv), "args": vars(args), "model": path}
    result["engine_batch"] = engine_batch(llm, prompts, outputs)
    if not args.skip_hf_batch:
        result["hf_batch"] = hf_static_batches(hf, prompts, outputs, args.batch_size)
    result["prefill"] = prefill(llm, hf, args.prefill_len, vocab)
    result["decode_ms"] = {str(b): decode_step_ms(llm, b, args.decode_steps, vocab) for b in args.decode_batches}
    if args.profile:
        n = min(PROFILE_PROMPTS, len(prompts))
        result["profile"] = profile_requests(llm, prompts[:n], int(median(outputs[:n])),
                                             f"{n} requests of the mixed batch together")
    plot(result)
    publish(NAME, result, render(result))
    return 0


def render(result: dict) -> str:
    eng, pre = result["engine_batch"], result["prefill"]
    rows = [[ENGINE, eng["seconds"], eng["output_tok_s"], 1.0]]
    if "hf_batch" in result:
        hf = result["hf_batch"]
        rows.append([HF, hf["seconds"], hf["output_tok_s"],
                     hf["output_tok_s"] / eng["output_tok_s"]])
        rows[0][3] = eng["output_tok_s"] / hf["output_tok_s"]
    text = "Mixed batch (ratio column: engine / transformers)\n\n"
    text += markdown_table(["system", "seconds", "output tok/s", "ratio"], rows)
    text += f"\nPrefill of {pre['prompt_len']} tokens\n\n"
    text += markdown_table(
        ["system", "seconds", "tok/s"],
        [["engine TTFT", pre["engine_s"], pre["engine_tok_s"]], ["transformers forward", pre["hf_forward_s"], pre["hf_tok_s"]]],
    )
    text += f"\nprefill ratio engine/transformers: {pre['engine_tok_s'] / pre['hf_tok_s']:.2f}\n"
    text += "\nDecode step\n\n" + markdown_table(["batch", "ms/step"], [[b, ms] for b, ms in result["decode_ms"].items()])
    return text + profile_tables(result)


def plot(result: dict) -> None:
    systems = {ENGINE: result["engine_batch"], **({HF: result["hf_batch"]} if "hf_batch" in result else {})}
    pre = result["prefill"]
    batches = [int(b) for b in result["decode_ms"]]
    step_ms = list(result["decode_ms"].values())
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Mixed batch", "", "output tokens/s", ["engine", "transformers"][: len(systems)],
                    plots.columns(systems, {"output tok/s": "output_tok_s"}), kind="bar"),
        plots.Panel(f"Prefill of {pre['prompt_len']} tokens", "", "tokens/s", ["engine TTFT", "transformers forward"],
                    {"tok/s": [pre["engine_tok_s"], pre["hf_tok_s"]]}, kind="bar"),
        plots.Panel("Decode step", "requests decoding", "ms", batches,
                    {"per step": step_ms, "per request": [ms / b for ms, b in zip(step_ms, batches, strict=True)]},
                    logy=True),
    ], "Engine vs transformers, same weights, same process")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    args, eng, pre = result["args"], result["engine_batch"], result["prefill"]
    text = (f"Mixed batch of {args['num_prompts']} requests (prompts of {args['prompt_len'][0]}-{args['prompt_len'][1]} "
            f"tokens, outputs of {args['output_len'][0]}-{args['output_len'][1]}): the engine produced "
            f"{eng['output_tok_s']:.0f} output tok/s")
    if "hf_batch" in result:
        hf = result["hf_batch"]
        text += f" against {hf['output_tok_s']:.0f} for transformers ({eng['output_tok_s'] / hf['output_tok_s']:.2f}x)"
        if eng["output_tok_s"] > hf["output_tok_s"]:
            text += (f": a static batch of {args['batch_size']} decodes until its longest output with its finished "
                     "rows still in it, while continuous batching gives a finished request's seat to a waiting one")
    text += (f". Prefill of {pre['prompt_len']} tokens: engine TTFT {1000 * pre['engine_s']:.0f} ms, one transformers "
             f"forward {1000 * pre['hf_forward_s']:.0f} ms (engine at {100 * pre['engine_tok_s'] / pre['hf_tok_s']:.0f}% "
             "of transformers' tokens/s; the same matmuls, plus the engine's KV writes, paged attention, sampling "
             "and scheduling). ")
    decode = {int(b): ms for b, ms in result["decode_ms"].items()}
    small, large = min(decode), max(decode)
    if large > small:
        text += (f"Decode: a step takes {decode[small]:.1f} ms with {small} request(s) and {decode[large]:.0f} ms with "
                 f"{large}, {decode[large] / large:.1f} ms per request: batching makes a token "
                 f"{decode[small] / small / (decode[large] / large):.1f}x cheaper, since a step reads the weights once "
                 "for the whole batch. ")
    return (text + profile_note(result)).strip()
