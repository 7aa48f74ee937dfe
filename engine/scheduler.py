"""Continuous batching with one token budget, chunked prefill and recompute preemption.

Each `schedule()` walks the running requests in admission order (decodes and unfinished
prefill chunks), then admits waiting ones first come first served. A request gets
`min(remaining tokens, remaining budget)` tokens, so long prompts are chunked across
steps and prefill chunks share a step with decodes. When the pool runs out of blocks the
most recently admitted running request is preempted (recompute): its blocks are freed
but keep their hashes, so its resume usually hits the prefix cache.

Block hashes: `add_request` hashes the prompt's full blocks and `update_from_output`
hashes each output block as it fills, both with the `BlockHasher` given here.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from engine.block_pool import KVBlock
from engine.config import EngineConfig
from engine.hashing import BlockHasher
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus

SampledTokens = dict[str, tuple[int, float | None]]


class RequestTooLongError(ValueError):
    """A request that can never run: longer than --max-model-len or than the KV pool."""


@dataclass
class SchedulerOutput:
    """One step's batch; the i-th entry of every list describes `requests[i]`.

    `start_positions[i]` is the request's num_computed_tokens before this step, so the
    step computes positions start .. start + num_new_tokens - 1; `sample[i]` is True when
    that run ends at the request's last known token (a token is sampled from it)."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    start_positions: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    connector_meta: object | None = None

    @property
    def total_num_tokens(self) -> int:
        return sum(self.num_new_tokens)


class SchedulerConnector(Protocol):
    """The scheduler side of the KV connector (DESIGN.md), as this scheduler calls it.

    - `get_num_new_matched_tokens`: at admission, after the device prefix hit of
      `num_computed_tokens` tokens: how many further tokens the store can supply, and
      whether loading them is asynchronous (not supported yet: raises).
    - `update_state_after_alloc`: after a successful admission, with the request's whole
      block table; the external tokens go right after the device prefix hit.
    - `build_meta`: once per step, the worker-side metadata (`SchedulerOutput.connector_meta`).
    - `request_finished`: when a request finishes; True keeps its blocks until the
      engine reports the save done with `Scheduler.finish_saving`."""

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]: ...

    def update_state_after_alloc(
        self, request: Request, blocks: list[KVBlock], num_external_tokens: int
    ) -> None: ...

    def build_meta(self, output: SchedulerOutput) -> object: ...

    def request_finished(self, request: Request, block_ids: list[int]) -> bool: ...


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv_cache_manager: KVCacheManager,
        block_hasher: BlockHasher,
        connector: SchedulerConnector | None = None,
    ) -> None:
        if block_hasher.block_size != kv_cache_manager.block_size:
            raise ValueError("the block hasher and the KV cache manager disagree on block size")
        self.config = config
        self.kv = kv_cache_manager
        self.block_hasher = block_hasher
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.saving: dict[str, Request] = {}
        self.num_preemptions_total = 0

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, hashing its prompt blocks. Raises RequestTooLongError when it
        could never run, ValueError for an empty prompt or a duplicate id."""
        self._validate(request)
        self.block_hasher.extend(request.block_hashes, request.prompt_token_ids, request.cache_salt)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Finish unfinished requests from outside a step (abort, stop string, error)."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        finished = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_saving(self, request_ids: list[str]) -> None:
        """Free the blocks of finished requests whose KV the connector has saved."""
        for request_id in request_ids:
            request = self.saving.pop(request_id, None)
            if request is not None:
                self.kv.free(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def stats(self) -> dict[str, int | float]:
        """Counters under vLLM's metric names; prefix-cache counts are tokens."""
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "num_preemptions_total": self.num_preemptions_total,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "kv_cache_usage_perc": self.kv.usage,
        }

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch and advance the chosen requests' num_computed_tokens."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        if self.connector is not None:
            out.connector_meta = self.connector.build_meta(out)
        return out

    def update_from_output(self, output: SchedulerOutput, sampled: SampledTokens) -> list[Request]:
        """Apply one executed step: append sampled tokens, cache the blocks it computed,
        finish and free the requests that stopped. Returns those finished requests."""
        finished = []
        for request, sample in zip(output.requests, output.sample, strict=True):
            if request.is_finished:
                continue
            if sample:
                token_id, logprob = sampled[request.request_id]
                request.append_output_token(token_id, logprob)
                self._extend_hashes(request)
            self.kv.cache_blocks(request, request.num_computed_tokens)
            status = self._stop_status(request) if sample else None
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    # ---- internals ------------------------------------------------------------------------

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        num_prompt = request.num_prompt_tokens
        max_tokens = request.sampling_params.max_tokens
        total = num_prompt + max_tokens
        max_model_len = self.config.max_model_len
        if max_model_len is not None and total > max_model_len:
            raise RequestTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) = {total} tokens "
                f"exceeds --max-model-len {max_model_len}"
            )
        # The last sampled token is never fed back, so its KV slot is never needed.
        num_blocks = cdiv(total - 1, self.kv.block_size)
        if num_blocks > self.kv.num_blocks:
            raise RequestTooLongError(
                f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) needs {num_blocks} "
                f"KV blocks, the whole pool has {self.kv.num_blocks}"
            )

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._allocate_or_preempt(request, num_new, out):
                break
            self._add_to_output(out, request, num_new)
            budget -= num_new
            index += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Preempt the most recently admitted running requests until `request` fits;
        False when `request` itself had to go. Victims are never already scheduled in
        this step: they come after `request` in admission order."""
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            num_new = self._admit(request, budget)
            if num_new is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            self._add_to_output(out, request, num_new)
            budget -= num_new

    def _admit(self, request: Request, budget: int) -> int | None:
        """Prefix lookup and allocation for a waiting request; its first chunk's size,
        or None when the pool cannot hold it now."""
        hits, num_local = self.kv.get_computed_blocks(request)
        num_external = self._num_external_tokens(request, num_local)
        num_computed = num_local + num_external
        num_new = min(request.num_tokens - num_computed, budget)
        if self.kv.allocate_slots(request, num_new, hits, num_external) is None:
            return None
        if self.connector is not None:
            blocks = self.kv.get_blocks(request.request_id)
            self.connector.update_state_after_alloc(request, blocks, num_external)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_computed
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        return num_new

    def _num_external_tokens(self, request: Request, num_computed: int) -> int:
        """Tokens the connector can load after the device hit, leaving the last token
        to compute."""
        if self.connector is None:
            return 0
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_computed)
        if load_async:
            raise NotImplementedError(
                "asynchronous KV loads (WAITING_FOR_REMOTE_KV) are not supported yet"
            )
        return max(min(num_external, request.num_tokens - 1 - num_computed), 0)

    def _add_to_output(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        out.start_positions.append(start)
        out.block_tables.append(self.kv.get_block_ids(request.request_id))
        out.sample.append(start + num_new == request.num_tokens)
        request.num_computed_tokens = start + num_new

    def _extend_hashes(self, request: Request) -> None:
        """Hash the output block the last token filled, if it filled one."""
        if request.num_tokens >= (len(request.block_hashes) + 1) * self.kv.block_size:
            self.block_hasher.extend(request.block_hashes, request.all_token_ids, request.cache_salt)

    def _stop_status(self, request: Request) -> RequestStatus | None:
        """Why the request stops after its newest token (vLLM's order: EOS, stop token
        ids, length). max_model_len needs no check: add_request rejects any request whose
        prompt + max_tokens exceeds it."""
        token_id = request.output_token_ids[-1]
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.finish_time = time.monotonic()
        del self.requests[request.request_id]
        block_ids = self.kv.get_block_ids(request.request_id)
        if self.connector is not None and self.connector.request_finished(request, block_ids):
            self.saving[request.request_id] = request
        else:
            self.kv.free(request)
