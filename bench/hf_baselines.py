"""Hugging Face transformers on the same weights: the baselines of the engine workloads.

- `forward_seconds`: one forward over a prompt without a KV cache (the prefill baseline).
- `DecodeSteps`: greedy decode steps of a batch of equal-length prompts with
  transformers' KV cache, after their prefill (the decode baselines).
- `static_batches`: `model.generate` on left-padded batches of `batch_size` prompts; a
  batch starts when the previous one has finished (static batching), and runs until its
  longest requested output. TTFT is measured from the batch start to the first call of
  the logits processors, i.e. after prefill.
- `continuous_batching`: transformers' own continuous batching (the
  `ContinuousBatchingManager` behind `model.generate_batch`) driven by `concurrency`
  closed-loop clients, each sending its next prompt when its previous answer is done.
  TTFT is the first token's timestamp minus the submit time. It runs on CPU (paged
  cache with the SDPA/eager paged attention; flash attention and CUDA graphs are off).

Both force exactly `max_tokens` greedy tokens per prompt (EOS ignored; a static batch
counts only each prompt's own), as the engine workloads do, warm up first as the engine does, and return a `bench.driver.Run` (no
prefix hits: neither keeps a cache across requests here) timed over the requests alone
(model loading, cache allocation and warm-up excluded).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
)
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.requests import GenerationOutput

from bench.console import progress
from bench.driver import Record, Run

PAD_ID = 0
NO_EOS = -1
RESULT_POLL_S = 1.0
WARMUP_PROMPT = [5] * 16


def load_model(path: str, dtype: str) -> PreTrainedModel:
    """The model in eval mode, after one short generate call (first-call costs paid)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    _static_batch(model, [WARMUP_PROMPT], [2], "")
    return model


class _FirstTokenClock(LogitsProcessor):
    """Notes when generation first asks for logits processing: the prefill is done."""

    def __init__(self) -> None:
        self.first: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first is None:
            self.first = time.perf_counter()
        return scores


def forward_seconds(model: PreTrainedModel, token_ids: list[int], logits_to_keep: int = 0) -> float:
    """Wall time of one forward over `token_ids` without a KV cache: every position's
    logits (0, a plain forward) or only the last `logits_to_keep` (generate's prefill)."""
    ids = torch.tensor([token_ids])
    with torch.inference_mode():
        start = time.perf_counter()
        model(ids, use_cache=False, logits_to_keep=logits_to_keep)
        return time.perf_counter() - start


class DecodeSteps:
    """Greedy decoding of a batch of equal-length prompts (so no padding) with
    transformers' KV cache, one step per call after their prefill."""

    def __init__(self, model: PreTrainedModel, prompts: Sequence[list[int]]) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            self.logits = model(torch.tensor(prompts), cache=self.cache, use_cache=True, logits_to_keep=1).logits

    def step_seconds(self) -> float:
        with torch.inference_mode():
            start = time.perf_counter()
            self.logits = self.model(self.logits[:, -1:].argmax(-1), cache=self.cache, use_cache=True).logits
            return time.perf_counter() - start


def static_batches(model: PreTrainedModel, prompts: Sequence[list[int]], max_tokens: int | Sequence[int],
                   batch_size: int, tag: str = "") -> Run:
    """`max_tokens`: one output length for every prompt, or one per prompt."""
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    records: list[Record] = []
    start, cpu_start = time.perf_counter(), time.process_time()
    batches = range(0, len(prompts), batch_size)
    for first in progress(batches, desc=f"transformers generate batch={batch_size}"):
        rows = slice(first, first + batch_size)
        records += _static_batch(model, prompts[rows], lengths[rows], tag)
    return Run(records, time.perf_counter() - start, time.process_time() - cpu_start)


def _static_batch(model: PreTrainedModel, batch: Sequence[list[int]], lengths: Sequence[int], tag: str) -> list[Record]:
    width = max(map(len, batch))
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    clock = _FirstTokenClock()
    longest = max(lengths)
    start = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                       do_sample=False, pad_token_id=PAD_ID, logits_processor=LogitsProcessorList([clock]))
    end = time.perf_counter()
    ttft = (clock.first or end) - start
    return [_record(tag, i, len(p), n, ttft, end - start) for i, (p, n) in enumerate(zip(batch, lengths, strict=True))]


def continuous_batching(model: PreTrainedModel, prompts: Sequence[list[int]], max_tokens: int, concurrency: int,
                        kv_tokens: int, max_batch_tokens: int, tag: str = "") -> Run:
    """Closed loop of `concurrency` clients over transformers' continuous batching, with a
    KV cache of about `kv_tokens` tokens and a per-step token budget of `max_batch_tokens`."""
    config = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, max_requests_per_batch=concurrency)
    config.num_blocks = -(-kv_tokens // config.page_size)
    generation = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=NO_EOS,
                                  pad_token_id=PAD_ID)
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.start()
    try:
        _closed_loop(manager, [WARMUP_PROMPT], 2, 1, "")
        start, cpu_start = time.perf_counter(), time.process_time()
        records = _closed_loop(manager, prompts, max_tokens, concurrency, tag)
        return Run(records, time.perf_counter() - start, time.process_time() - cpu_start)
    finally:
        manager.stop(block=True)
        manager.destroy()


def _closed_loop(manager: ContinuousBatchingManager, prompts: Sequence[list[int]], max_tokens: int, concurrency: int,
                 tag: str) -> list[Record]:
    sent: dict[str, tuple[int, float]] = {}
    prefix = f"hf-{time.perf_counter_ns()}"

    def submit(index: int) -> None:
        request_id = f"{prefix}-{index}"
        sent[request_id] = (index, time.perf_counter())
        manager.add_request(prompts[index], request_id=request_id, max_new_tokens=max_tokens,
                            record_timestamps=True, eos_token_id=NO_EOS)

    for index in range(min(concurrency, len(prompts))):
        submit(index)
    records: list[Record] = []
    with progress(total=len(prompts), desc=f"transformers continuous batching c={concurrency}") as bar:
        while len(records) < len(prompts):
            result = manager.get_result(timeout=RESULT_POLL_S)
            if result is None or not result.is_finished():
                _check_alive(manager)
                continue
            index, submitted = sent[result.request_id]
            records.append(_cb_record(result, tag, index, submitted))
            bar.update(1)
            if len(sent) < len(prompts):
                submit(len(sent))
    return records


def _check_alive(manager: ContinuousBatchingManager) -> None:
    if not manager.is_running():
        raise RuntimeError("transformers continuous batching stopped before all requests finished")


def _cb_record(result: GenerationOutput, tag: str, index: int, submitted: float) -> Record:
    stamps = result.timestamps or [time.perf_counter()]
    return _record(tag, index, len(result.prompt_ids), len(result.generated_tokens),
                   stamps[0] - submitted, stamps[-1] - submitted, error=result.error is not None)


def _record(tag: str, index: int, prompt_tokens: int, output_tokens: int, ttft: float, latency: float,
            error: bool = False) -> Record:
    return Record(tag=tag, session=index, prompt_tokens=prompt_tokens, output_tokens=output_tokens, ttft=ttft,
                  latency=latency, device_hit_tokens=0, store_hit_tokens=0, preemptions=0, error=error)
