"""Runs one scheduler step on the model: flattened varlen batch in, sampled tokens out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from connectors.base import NullConnector, WorkerConnector
from engine.blend.forward import BlendPlan, ShiftRotary, blend_prefill
from engine.logprobs import TokenLogprob, TopLogprobs
from engine.request import Request
from engine.sampler import Sampler, make_generator, token_logprobs
from engine.scheduler import SchedulerOutput
from engine.structured_output import MaskBuilder, apply_masks
from kvkernels.metadata import AttentionMetadata

# request id -> (token id, its logprob and rank, the top logprobs), logprobs None unless asked
SampledTokens = dict[str, tuple[int, TokenLogprob | None, TopLogprobs | None]]


# Rows of prompt logits turned into logprobs at once: bounds the [rows, vocab] fp32
# buffers of a long prefill chunk (256 rows of a 152k vocabulary: 155 MB).
PROMPT_LOGPROBS_ROWS = 256


class KVLoadError(RuntimeError):
    """The connector failed to write a step's loaded KV into the device cache: the step
    cannot run again (part of its KV may be missing), its requests fail."""


@dataclass
class PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # row of each sampled request's last token
    sampled_requests: list  # the requests that get a token this step
    # (request, first row, position of that row, rows): the rows whose logits give prompt
    # logprobs still missing, the logprobs of prompt tokens position + 1, ...
    prompt_logprob_runs: list[tuple[Request, int, int, int]]


def allocate_kv_cache(
    num_blocks: int, num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor:
    """The block-major device KV pool (layout in docs/ARCHITECTURE.md)."""
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


class ModelRunner:
    """Runs steps; the connector's worker side writes loaded KV into the cache before
    the forward and copies completed chunks out after it."""

    def __init__(
        self, model: torch.nn.Module, kv_cache: torch.Tensor, block_size: int,
        connector: WorkerConnector | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.connector: WorkerConnector = connector or NullConnector()
        self.device = kv_cache.device
        self.sampler = Sampler()
        self._masks = MaskBuilder()  # structured outputs' token masks, built during the forward
        self._generators: dict[str, torch.Generator] = {}
        self._rotary: ShiftRotary | None = None  # see `blend`

    def execute(self, out: SchedulerOutput) -> SampledTokens:
        """Run one step. Without `connector_meta` (part of a failed step run again: its
        loads are in the cache already, its saves are dropped) the connector is skipped.
        Raises KVLoadError if loading the step's KV failed, anything else as it comes."""
        with torch.inference_mode():
            if out.connector_meta is not None:
                self._start_load(out.connector_meta)
            batch = self.prepare(out)
            guided = [row for row, r in enumerate(batch.sampled_requests) if r.grammar is not None]
            masks = self._masks.start([batch.sampled_requests[row].grammar for row in guided]) if guided else None
            hidden = self.model(batch.input_ids, batch.positions, self.kv_cache, batch.meta)
            self._record_prompt_logprobs(batch.prompt_logprob_runs, hidden)
            if out.connector_meta is not None:
                self.connector.wait_for_save()
            if not batch.sampled_requests:
                return {}
            logits = self.model.compute_logits(hidden[batch.sample_rows])
            if masks is not None:
                apply_masks(logits, guided, masks.result())
        return self._sample(batch.sampled_requests, logits)

    def _start_load(self, meta: object) -> None:
        try:
            self.connector.start_load_kv(meta)
        except Exception as exc:
            raise KVLoadError(f"loading KV into the device cache failed: {exc}") from exc

    def blend(self, plan: BlendPlan) -> list[int]:
        """Compute a blended prefill's region into the KV cache (engine/blend/forward.py):
        the rows it computed in context. On failure the region's slots are zeroed (a
        forward that raised may have left anything there) before the error goes up."""
        try:
            with torch.inference_mode():
                if self._rotary is None:  # built at the first blend: most engines never blend
                    self._rotary = ShiftRotary(self.model)
                result = blend_prefill(self.model, self.kv_cache, plan, self._rotary)
        except Exception:
            dest = plan.dest_slots
            self.kv_cache[dest // self.block_size, :, :, dest % self.block_size] = 0
            raise
        return result.rows.tolist()

    def release(self, request_id: str) -> None:
        """Forget a finished request's seeded generator."""
        self._generators.pop(request_id, None)

    def prepare(self, out: SchedulerOutput) -> PreparedBatch:
        """The step's flattened batch: Python lists built per request, then one tensor
        each (a decode step of many requests is a few list appends per request)."""
        token_ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled = []
        prompt_runs = []
        for req, num_new, start, sample in zip(
            out.requests, out.num_new_tokens, out.start_positions, out.sample, strict=True
        ):
            end = start + num_new
            if req.num_prompt_logprobs_missing:
                # row p predicts prompt token p + 1; the first len(prompt_logprobs) are in
                first, last = max(start, len(req.prompt_logprobs)), min(end, req.num_prompt_tokens - 1)
                if last > first:
                    prompt_runs.append((req, len(token_ids) + first - start, first, last - first))
            token_ids += req.token_ids_between(start, end)
            positions += range(start, end)
            seq_lens.append(end)
            if sample:
                sample_rows.append(len(token_ids) - 1)
                sampled.append(req)
        query_lens = list(out.num_new_tokens)
        position_t = torch.tensor(positions, dtype=torch.long)
        block_tables = _pad_block_tables(out.block_tables)
        meta = AttentionMetadata(
            query_start_loc=self._to_device(_cumsum_with_zero(query_lens)),
            seq_lens=self._to_device(torch.tensor(seq_lens, dtype=torch.int32)),
            block_tables=self._to_device(block_tables),
            slot_mapping=self._to_device(self._slot_mapping(block_tables, query_lens, position_t)),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return PreparedBatch(
            input_ids=self._to_device(torch.tensor(token_ids, dtype=torch.long)),
            positions=self._to_device(position_t),
            meta=meta,
            sample_rows=self._to_device(torch.tensor(sample_rows, dtype=torch.long)),
            sampled_requests=sampled,
            prompt_logprob_runs=prompt_runs,
        )

    def _record_prompt_logprobs(self, runs: list[tuple[Request, int, int, int]], hidden: torch.Tensor) -> None:
        """Give each request of `runs` the logprobs of the prompt tokens its rows of
        `hidden` predict (with the top `prompt_logprobs` tokens), as vLLM's prompt logprobs.
        They go on the request itself, which keeps them across the chunks of its prefill;
        a step run again records nothing twice (Request.add_prompt_logprobs)."""
        for request, row, position, count in runs:
            num_top = request.sampling_params.prompt_logprobs
            for offset in range(0, count, PROMPT_LOGPROBS_ROWS):
                rows = min(PROMPT_LOGPROBS_ROWS, count - offset)
                logits = self.model.compute_logits(hidden[row + offset : row + offset + rows])
                first = position + offset + 1
                targets = torch.tensor(request.prompt_token_ids[first : first + rows], device=logits.device)
                logprobs, top = token_logprobs(logits, targets, [num_top] * rows)
                request.add_prompt_logprobs(first, logprobs, top)

    def clear_step_kv(self, out: SchedulerOutput) -> None:
        """Zero, in every layer, the KV slots that `out` writes. A forward that raised may
        have left anything there (NaN included), and the torch decode reads stale slots
        of reused blocks past a sequence's end (kvkernels/reference.py). The slots lie past
        each request's cached blocks, so no other request's KV is touched."""
        runs = zip(out.start_positions, out.num_new_tokens, strict=True)
        positions = torch.cat([torch.arange(start, start + n) for start, n in runs])
        tables = _pad_block_tables(out.block_tables)
        slots = self._slot_mapping(tables, list(out.num_new_tokens), positions).to(self.kv_cache.device)
        self.kv_cache[slots // self.block_size, :, :, slots % self.block_size] = 0

    def _slot_mapping(
        self, block_tables: torch.Tensor, query_lens: list[int], positions: torch.Tensor
    ) -> torch.Tensor:
        seq_index = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens))
        blocks = block_tables[seq_index, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size

    def _sample(self, requests: list, logits: torch.Tensor) -> SampledTokens:
        params = [r.sampling_params for r in requests]
        generators = [self._generator_for(r) for r in requests]
        tokens, logprobs, top = self.sampler.sample(logits, params, generators)
        if logprobs is None:
            return {r.request_id: (tok, None, None) for r, tok in zip(requests, tokens, strict=True)}
        return {
            r.request_id: (tok, lp, k) if r.sampling_params.logprobs is not None else (tok, None, None)
            for r, tok, lp, k in zip(requests, tokens, logprobs, top, strict=True)
        }

    def _generator_for(self, request) -> torch.Generator | None:
        seed = request.sampling_params.seed
        if seed is None or request.sampling_params.greedy:
            return None
        if request.request_id not in self._generators:
            self._generators[request.request_id] = make_generator(seed, self.device)
        return self._generators[request.request_id]

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)


def _pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    """The block tables as one int32 tensor, rows padded with 0 (one tensor construction)."""
    width = max(max(len(t) for t in tables), 1)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def _cumsum_with_zero(lengths: list[int]) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), dim=0)
    return out
