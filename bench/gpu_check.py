"""GPU check for the kernels (never run in CI): about 2-4 minutes on one CUDA device.

1. Each Triton kernel against the torch reference on realistic shapes (errors and ms).
2. The engine with a tiny model on the GPU (Triton and torch kernels) against
   transformers greedy generation.
3. Gather/scatter GB/s (Triton vs torch indexing) and device<->host GB/s of the pinned
   slot path (side stream, one run or scattered blocks) vs a plain `tensor.copy_`.

    python bench/gpu_check.py --out bench/results/gpu_check.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Result = dict[str, Any]


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not torch.cuda.is_available():
        print("gpu_check needs a CUDA device; none found")
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    report: Result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    sections: dict[str, Callable[[argparse.Namespace], Result]] = {
        "kernels": check_kernels,
        "engine": check_engine,
        "bandwidth": check_bandwidth,
    }
    for name, section in sections.items():
        if name in args.skip:
            continue
        start = time.perf_counter()
        report[name] = _guarded(section, args)
        print(f"[{name}] {time.perf_counter() - start:.1f} s")
    _print_table(report)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if _all_ok(report) else 1


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results/gpu_check.json", help="JSON report path")
    parser.add_argument("--skip", nargs="*", default=[], choices=["kernels", "engine", "bandwidth"])
    parser.add_argument("--chunk-mib", type=int, default=256, help="bytes moved per copy test")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per engine prompt")
    return parser.parse_args(argv)


def _guarded(section: Callable[[argparse.Namespace], Result], args: argparse.Namespace) -> Result:
    try:
        return section(args)
    except Exception:
        traceback.print_exc()
        return {"ok": False, "error": traceback.format_exc(limit=4)}


def _all_ok(report: Result) -> bool:
    return all(v.get("ok", True) for v in report.values() if isinstance(v, dict))


def cuda_ms(fn: Callable[[], object], iters: int = 20) -> float:
    """Mean milliseconds per call, timed with CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def wall_ms(fn: Callable[[], object], iters: int = 5) -> float:
    """Mean wall-clock milliseconds per call, for host-synchronised copies."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / iters


# ---------------------------------------------------------------- 1. kernels vs reference


def random_paged_batch(
    shapes: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    page: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(query, kv_layer, meta) on CUDA; blocks shuffled, `shapes` = (query_len, seq_len)."""
    from kvkernels.metadata import AttentionMetadata

    needed = [-(-s // page) for _, s in shapes]
    order = torch.randperm(sum(needed) + 8)
    kv_layer = torch.randn(len(order), 2, page, kv_heads, head_dim, device="cuda").to(dtype)
    tables = torch.zeros(len(shapes), max(needed), dtype=torch.int32)
    slots, used = [], 0
    for i, ((q_len, seq_len), n) in enumerate(zip(shapes, needed, strict=True)):
        tables[i, :n] = order[used : used + n]
        used += n
        pos = torch.arange(seq_len - q_len, seq_len)
        slots.append(tables[i, pos // page].long() * page + pos % page)
    q_lens, seq_lens = [q for q, _ in shapes], [s for _, s in shapes]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).int().cuda(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=tables.cuda(),
        slot_mapping=torch.cat(slots).cuda(),
        query_lens_cpu=q_lens,
        seq_lens_cpu=seq_lens,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(sum(q_lens), heads, head_dim, device="cuda").to(dtype)
    return query, kv_layer, meta


ATTENTION_CASES = {
    "prefill 2x2048": [(2048, 2048)] * 2,
    "decode 64 @ 2k": [(1, 2048)] * 64,
    "mixed 2x512 chunk + 62 decodes": [(512, 1536)] * 2 + [(1, 1000 + 17 * i) for i in range(62)],
}


def check_kernels(args: argparse.Namespace) -> Result:
    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for heads, kv_heads, head_dim in ((32, 8, 128), (16, 2, 64)):
            for name, shapes in ATTENTION_CASES.items():
                rows.append(_attention_row(name, shapes, heads, kv_heads, head_dim, dtype))
    rows.append(_write_kv_row())
    rows.append(_gather_scatter_row())
    return {"ok": all(r["ok"] for r in rows), "rows": rows}


def _attention_row(
    name: str, shapes: list, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> Result:
    from kvkernels import reference, triton_attention

    query, kv_layer, meta = random_paged_batch(shapes, heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    out = triton_attention.paged_attention(query, kv_layer, meta, scale)
    ref = reference.paged_attention(query, kv_layer, meta, scale)
    err = (out.float() - ref.float()).abs().max().item()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    return {
        "kernel": "paged_attention",
        "case": f"{name} h{heads}/kv{kv_heads} d{head_dim} {str(dtype)[6:]}",
        "max_abs_err": err,
        "ok": err <= tol,
        "triton_ms": cuda_ms(
            lambda: triton_attention.paged_attention(query, kv_layer, meta, scale)
        ),
        "torch_ms": cuda_ms(lambda: reference.paged_attention(query, kv_layer, meta, scale), 5),
    }


def _write_kv_row() -> Result:
    from kvkernels import reference, triton_kv_ops

    _, kv_layer, meta = random_paged_batch([(512, 1536)] * 4, 32, 8, 128, torch.bfloat16)
    key = torch.randn(meta.num_tokens, 8, 128, device="cuda")
    value = torch.randn_like(key)
    slots = meta.slot_mapping.clone()
    slots[::7] = -1
    expected = kv_layer.clone()
    reference.write_kv(expected, key, value, slots)
    triton_kv_ops.write_kv(kv_layer, key, value, slots)
    return {
        "kernel": "write_kv",
        "case": "2048 tokens kv8 d128 bf16",
        "ok": torch.equal(kv_layer, expected),
        "triton_ms": cuda_ms(lambda: triton_kv_ops.write_kv(kv_layer, key, value, slots)),
        "torch_ms": cuda_ms(lambda: reference.write_kv(kv_layer, key, value, slots)),
    }


def _gather_scatter_row() -> Result:
    from kvkernels import triton_kv_ops

    cache = _random_cache(512)
    ids = torch.randperm(512, device="cuda")[:128]
    chunk = torch.empty(128, *cache.shape[1:], dtype=cache.dtype, device="cuda")
    triton_kv_ops.gather_blocks(cache, ids, chunk)
    restored = torch.zeros_like(cache)
    triton_kv_ops.scatter_blocks(restored, ids, chunk)
    ok = torch.equal(chunk.view(torch.int16), cache[ids].view(torch.int16))
    ok = ok and torch.equal(restored[ids].view(torch.int16), cache[ids].view(torch.int16))
    return {"kernel": "gather/scatter", "case": "128 of 512 blocks, byte-exact", "ok": ok}


def _random_cache(num_blocks: int, layers: int = 8) -> torch.Tensor:
    """A bf16 block-major cache `[blocks, layers, 2, 16, 8, 128]` (512 KiB per block)."""
    shape = (num_blocks, layers, 2, 16, 8, 128)
    return torch.randn(shape, device="cuda").to(torch.bfloat16)


# ---------------------------------------------------------------- 2. engine vs transformers


def check_engine(args: argparse.Namespace) -> Result:
    from transformers import AutoConfig

    from engine.random_model import make_model

    with tempfile.TemporaryDirectory() as tmp:
        path = make_model(tmp, preset="tiny")
        vocab = AutoConfig.from_pretrained(path).vocab_size
        gen = torch.Generator().manual_seed(0)
        lengths = [1, 7, 40, 129, 300, 517]
        prompts = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
        expected = _transformers_greedy(path, prompts, args.max_tokens)
        results = {
            backend: _engine_greedy(path, prompts, args.max_tokens, backend)
            for backend in ("auto", "torch")
        }
    rows = {
        backend: sum(got == want for got, want in zip(tokens, expected, strict=True))
        for backend, tokens in results.items()
    }
    return {
        "ok": all(n == len(prompts) for n in rows.values()),
        "prompts": len(prompts),
        "exact_matches": rows,
    }


def _transformers_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device="cuda")
            tokens = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
            )
            outputs.append(tokens[0, len(prompt) :].tolist())
    return outputs


def _engine_greedy(
    path: str, prompts: list[list[int]], max_tokens: int, backend: str
) -> list[list[int]]:
    import kvkernels
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with kvkernels.use_backend(backend):
        llm = LLM(model=path, dtype="float32", device="cuda", max_num_batched_tokens=256)
        outputs = llm.generate(prompts, params, use_tqdm=False)
    del llm
    torch.cuda.empty_cache()
    return [list(out.outputs[0].token_ids) for out in outputs]


# ---------------------------------------------------------------- 3. bandwidth


def check_bandwidth(args: argparse.Namespace) -> Result:
    from connectors.transfer import BlockCopier
    from kvkernels import reference, triton_kv_ops
    from tiers.cpu import allocate_host

    cache = _random_cache(2048)
    n = max(1, args.chunk_mib * 2**20 // cache[0].nbytes)
    ids = torch.randperm(2048, device="cuda")[:n]
    chunk = torch.empty(n, *cache.shape[1:], dtype=cache.dtype, device="cuda")
    nbytes = chunk.nbytes
    raw, pinned_with = allocate_host(nbytes, pin=True)
    pinned = raw.view(chunk.dtype).view(chunk.shape)
    plain = torch.empty(chunk.shape, dtype=chunk.dtype)
    copier = BlockCopier(cache)
    runs = list(range(n))  # one run of consecutive blocks: the best case of a record
    scattered = ids.tolist()  # blocks anywhere in the pool: one copy per block
    timings = {
        "gather triton": cuda_ms(lambda: triton_kv_ops.gather_blocks(cache, ids, chunk)),
        "gather torch": cuda_ms(lambda: reference.gather_blocks(cache, ids, chunk)),
        "scatter triton": cuda_ms(lambda: triton_kv_ops.scatter_blocks(cache, ids, chunk)),
        "scatter torch": cuda_ms(lambda: reference.scatter_blocks(cache, ids, chunk)),
        "D2H plain copy_": wall_ms(lambda: plain.copy_(chunk)),
        "H2D plain copy_": wall_ms(lambda: chunk.copy_(plain)),
        "save, one run (D2H pinned)": wall_ms(lambda: copier.from_device(runs, pinned).synchronize()),
        "load, one run (H2D pinned)": wall_ms(lambda: copier.to_device(pinned, runs).synchronize()),
        "save, scattered blocks": wall_ms(lambda: copier.from_device(scattered, pinned).synchronize()),
        "load, scattered blocks": wall_ms(lambda: copier.to_device(pinned, scattered).synchronize()),
    }
    rows = [{"op": op, "ms": ms, "GB/s": nbytes / ms / 1e6} for op, ms in timings.items()]
    return {"ok": True, "bytes": nbytes, "pinned_with": pinned_with, "rows": rows}


def _print_table(report: Result) -> None:
    kernels_rows = report.get("kernels", {}).get("rows", [])
    if kernels_rows:
        print(f"\n{'kernel':16} {'case':48} {'ok':>4} {'err':>9} {'triton ms':>10} {'torch ms':>9}")
    for row in kernels_rows:
        err = row.get("max_abs_err", 0.0)
        t_ms, r_ms = row.get("triton_ms", float("nan")), row.get("torch_ms", float("nan"))
        print(
            f"{row['kernel']:16} {row['case']:48} {row['ok']!s:>4} {err:9.2e} {t_ms:10.3f} {r_ms:9.3f}"
        )
    if "engine" in report:
        print(f"\nengine vs transformers greedy: {report['engine']}")
    bandwidth = report.get("bandwidth", {})
    if bandwidth.get("rows"):
        print(
            f"\n{bandwidth['bytes'] / 2**20:.0f} MiB per copy, pinned via {bandwidth['pinned_with']}"
        )
    for row in bandwidth.get("rows", []):
        print(f"{row['op']:28} {row['ms']:9.3f} ms {row['GB/s']:8.1f} GB/s")


if __name__ == "__main__":
    raise SystemExit(main())
