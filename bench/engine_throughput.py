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

from bench.common import machine_info, markdown_table, median, timed, write_result
from engine import LLM, SamplingParams
from engine.builtin_model import default_model_path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kvtier bench engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="Checkpoint directory (default: the built-in model).")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 1024), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--batch-size", type=int, default=64, help="Engine max_num_seqs and HF static batch size.")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--decode-batches", type=int, nargs="+", default=(1, 32))
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--skip-hf-batch", action="store_true", help="Skip the (slow) transformers batch baseline.")
    p.add_argument("--seed", type=int, default=0)
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
    args = parse_args(argv or [])
    torch.manual_seed(args.seed)
    path = args.model or default_model_path()
    llm = LLM(model=path, dtype=args.dtype, max_num_seqs=args.batch_size,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    vocab = llm.engine.spec.vocab_size
    prompts, outputs = make_workload(args, vocab)
    result = {"machine": machine_info(), "args": vars(args), "model": path}
    result["engine_batch"] = engine_batch(llm, prompts, outputs)
    if not args.skip_hf_batch:
        result["hf_batch"] = hf_static_batches(hf, prompts, outputs, args.batch_size)
    result["prefill"] = prefill(llm, hf, args.prefill_len, vocab)
    result["decode_ms"] = {str(b): decode_step_ms(llm, b, args.decode_steps, vocab) for b in args.decode_batches}
    write_result("engine", result, render(result))
    print(render(result))
    return 0


def render(result: dict) -> str:
    eng, pre = result["engine_batch"], result["prefill"]
    rows = [["engine (continuous batching)", eng["seconds"], eng["output_tok_s"], 1.0]]
    if "hf_batch" in result:
        hf = result["hf_batch"]
        rows.append(["transformers generate (static batches)", hf["seconds"], hf["output_tok_s"],
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
    return text
