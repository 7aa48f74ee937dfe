"""Continuous batching with one token budget, chunked prefill, preemption and KV loads.

Each `schedule()` first takes in the asynchronous KV loads that finished, then walks the
running requests in admission order (decodes and unfinished prefill chunks), then admits
waiting ones, fairly between groups (below). A request gets `min(remaining tokens, remaining
budget)` tokens, so long prompts are chunked across steps and prefill chunks share a step
with decodes. When the pool runs out of blocks the most recently admitted running
request is preempted: in offload mode the connector first saves its computed chunks;
then its blocks are freed but keep their hashes, so its resume usually hits the prefix
cache or the store.

The connector (connectors/base.py) is asked at admission how many tokens after the
device prefix hit the store can supply. A synchronous answer is admitted at once with
those tokens computed; an asynchronous one gets blocks for them and waits in `loading`
(status WAITING_FOR_REMOTE_KV, no compute, no budget, but a `max_num_seqs` slot) until
`get_finished` reports how many tokens really arrived; it then joins the running
requests and computes the rest. A request the connector cannot answer yet (None: its
store lookup is still out) keeps its place in the queue and is skipped for this step.
Requests still queued are handed to the connector's `prefetch`.

Parallel sampling (n > 1): the n sequences of one prompt share its KV. The first one
(the leader) is scheduled alone; its followers wait in `forks` and, once the leader's
prefill is done (the step that samples its first token), each takes a reference on the
leader's full prompt blocks (up to the block before the last prompt token) and joins the
front of the waiting queue holding them: admitted, it computes only the prompt's last
partial block itself (its own copy: what a copy-on-write of that block would copy, and
the logits of its first token), then decodes on its own blocks. A leader that finishes
before its prefill is done (abort, error) hands its followers to the waiting queue as
ordinary requests.

Fair admission. A group is the requests of one client call: the n sequences of a prompt,
and the prompts of one API call (`add_request`'s `group`). Each free `max_num_seqs` slot
goes to a waiting request of the group that holds the fewest slots (running or loading),
first come first served among equals. First come first served alone lets one call of
many prompts and sequences hold every slot while another client's short request waits
behind all of them; this way a newcomer takes the next slot that frees, so it waits at most for the shortest remaining run of the running sequences. Fair
admission rather than a fixed per-group share of the batch: a share would leave slots
idle while one call runs alone, and, without preempting, would not free a slot any
sooner when a newcomer arrives.

Block hashes: `add_request` hashes the prompt's full blocks and `update_from_output`
hashes each output block as it fills, both with the `BlockHasher` given here.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from dataclasses import dataclass, field
from itertools import chain, islice

from connectors.base import NullConnector, SchedulerConnector
from engine.block_pool import KVBlock
from engine.config import EngineConfig
from engine.hashing import BlockHasher
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.logprobs import TokenLogprob, TopLogprobs
from engine.request import Request, RequestStatus

SampledTokens = dict[str, tuple[int, TokenLogprob | None, TopLogprobs | None]]


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
        self.connector: SchedulerConnector = connector or NullConnector()
        self.offload_on_preempt = config.effective_preemption_mode == "offload"
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.num_lookups_pending = 0  # waiting requests the connector could not answer yet
        self.forks: dict[str, list[Request]] = {}  # leader id -> followers waiting for its prefill
        self.groups: dict[str, str] = {}  # request id -> its group, for fair admission
        self.num_preemptions_total = 0
        self.num_recomputed_tokens = 0

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self, request: Request, followers: list[Request] | None = None, group: str | None = None
    ) -> None:
        """Queue a request, hashing its prompt blocks; `followers` (same prompt and salt)
        are forked from it once its prefill is done. The request and its followers belong
        to `group` (default: the request's id) for fair admission. Raises
        RequestTooLongError when it could never run, ValueError for an empty prompt or a
        duplicate id."""
        members = [request, *(followers or [])]
        for member in members:
            self.validate(member)
        if len({m.request_id for m in members}) < len(members):
            raise ValueError("the requests of one group need distinct ids")
        self.block_hasher.extend(request.block_hashes, request.prompt_token_ids, request.cache_salt)
        for member in members:
            member.block_hashes = list(request.block_hashes)
            member.status = RequestStatus.WAITING
            self.requests[member.request_id] = member
            self.groups[member.request_id] = group or request.request_id
        self.waiting.append(request)
        if followers:
            self.forks[request.request_id] = list(followers)

    def add_running(self, request: Request) -> None:
        """Admit a request whose blocks, and KV of its first num_computed_tokens tokens,
        are in place already (a blended prefill, engine/blend); it runs from there."""
        request.status = RequestStatus.RUNNING
        request.peak_computed_tokens = request.num_computed_tokens
        self.requests[request.request_id] = request
        self.running.append(request)

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
            elif request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
                del self.loading[request_id]
            elif not self._drop_follower(request):
                self.waiting.remove(request)
            self._finish(request, status)
            finished.append(request)
        return finished

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def _drop_follower(self, request: Request) -> bool:
        """Take a follower that was not forked yet out of its group; False if it is none."""
        for followers in self.forks.values():
            if request in followers:
                followers.remove(request)
                return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting or self.loading)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_loading(self) -> int:
        """Requests waiting on the KV store: loading, or with a lookup still out."""
        return len(self.loading) + self.num_lookups_pending

    def stats(self) -> dict[str, int | float]:
        """Counters under vLLM's metric names; prefix-cache counts are tokens. Waiting
        includes the requests whose KV is loading; recomputed tokens are tokens computed
        again after a preemption."""
        return {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting) + len(self.loading),
            "num_requests_loading_kv": len(self.loading),
            "num_preemptions_total": self.num_preemptions_total,
            "num_recomputed_tokens": self.num_recomputed_tokens,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "kv_cache_usage_perc": self.kv.usage,
        }

    # ---- one step -------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch and advance the chosen requests' num_computed_tokens."""
        self._collect_transfers()
        self.num_lookups_pending = 0
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        self.connector.prefetch(list(islice(self.waiting, self.config.max_num_seqs)))
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
                request.append_output_token(*sampled[request.request_id])
                if request.grammar is not None and self._stop_status(request) is None:
                    self._jump_forward(request)
                self._extend_hashes(request)
            self.kv.cache_blocks(request, request.num_computed_tokens)
            if sample and request.request_id in self.forks:
                self._fork(request)
            status = self._stop_status(request) if sample else None
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if not r.is_finished]
        return finished

    # ---- internals ------------------------------------------------------------------------

    def validate(self, request: Request) -> None:
        """Raise ValueError (RequestTooLongError) for a request that can never run."""
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
        if self.offload_on_preempt:
            self.connector.request_preempted(request, self.kv.get_block_ids(request.request_id))
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests, fairly between groups (see the module docstring); one
        the connector cannot answer yet is skipped (it keeps its place), one that does not
        fit ends the admissions."""
        held = Counter(self._group(r) for r in chain(self.running, self.loading.values()))
        skipped: set[str] = set()
        while budget > 0 and len(self.running) + len(self.loading) < self.config.max_num_seqs:
            index = self._next_waiting(held, skipped)
            if index is None:
                break
            request = self.waiting[index]
            if self.kv.get_blocks(request.request_id):  # a follower holding its leader's blocks
                num_new = self._admit_fork(request, budget)
            else:
                hits, num_local = self.kv.get_computed_blocks(request)
                num_external, load_async = self._num_external_tokens(request, num_local)
                if num_external is None:
                    self.num_lookups_pending += 1
                    skipped.add(request.request_id)
                    continue
                if load_async:
                    if not self._start_remote_load(request, hits, num_local, num_external):
                        break
                    del self.waiting[index]
                    held[self._group(request)] += 1
                    continue
                num_new = self._admit(request, hits, num_local, num_external, budget)
            if num_new is None:
                break
            del self.waiting[index]
            held[self._group(request)] += 1
            self.running.append(request)
            self._add_to_output(out, request, num_new)
            budget -= num_new

    def _next_waiting(self, held: Counter[str], skipped: set[str]) -> int | None:
        """The position in `waiting` of the next request to admit: of the group holding
        the fewest slots, the first in line; None when every one is skipped."""
        best, best_held = None, 0
        for index, request in enumerate(self.waiting):
            if request.request_id in skipped:
                continue
            count = held[self._group(request)]
            if best is None or count < best_held:
                best, best_held = index, count
                if count == 0:  # nobody comes before a group that holds nothing
                    break
        return best

    def _group(self, request: Request) -> str:
        return self.groups.get(request.request_id, request.request_id)

    def _admit(
        self, request: Request, hits: list[KVBlock], num_local: int, num_external: int, budget: int
    ) -> int | None:
        """Allocation for a waiting request whose external tokens (if any) are loaded
        before this step's forward; its first chunk's size, or None when the pool cannot
        hold it now."""
        num_computed = num_local + num_external
        num_new = min(request.num_tokens - num_computed, budget)
        if self.kv.allocate_slots(request, num_new, hits, num_external) is None:
            return None
        block_ids = self.kv.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_computed
        self._note_admitted(request, num_local, num_external)
        return num_new

    def _fork(self, leader: Request) -> None:
        """The leader's prefill is done: its followers share its full prompt blocks and
        wait first in line (see the module docstring)."""
        followers = self.forks.pop(leader.request_id)
        num_shared = (leader.num_prompt_tokens - 1) // self.kv.block_size
        shared = self.kv.get_blocks(leader.request_id)[:num_shared]
        for follower in reversed(followers):
            self.kv.share_blocks(follower, shared)
            follower.num_computed_tokens = num_shared * self.kv.block_size
            self.waiting.appendleft(follower)

    def _admit_fork(self, request: Request, budget: int) -> int | None:
        """Allocation for a forked follower: its first chunk's size, or None when the
        pool cannot hold it now."""
        num_new = min(request.num_tokens - request.num_computed_tokens, budget)
        if self.kv.allocate_slots(request, num_new) is None:
            return None
        request.status = RequestStatus.RUNNING
        self._note_admitted(request, request.num_computed_tokens, 0)
        return num_new

    def _start_remote_load(
        self, request: Request, hits: list[KVBlock], num_local: int, num_external: int
    ) -> bool:
        """Admit a request whose external tokens load asynchronously: blocks for the
        device hit and the external tokens now, computing once the load is in. False
        when the pool cannot hold them now."""
        if self.kv.allocate_slots(request, 0, hits, num_external) is None:
            return False
        block_ids = self.kv.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        request.num_computed_tokens = num_local
        self.loading[request.request_id] = request
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        return True

    def _collect_transfers(self) -> None:
        """Move requests whose load finished to the running set, with the tokens that
        really arrived computed. (The KV store connector never keeps a finished
        request's blocks: its records are copied out in its last step.)"""
        for request_id, num_loaded in self.connector.get_finished().items():
            request = self.loading.pop(request_id, None)
            if request is None:
                continue
            num_local = request.num_computed_tokens
            request.num_computed_tokens = num_local + num_loaded
            request.status = RequestStatus.RUNNING
            self._note_admitted(request, num_local, num_loaded)
            self.running.append(request)

    def _note_admitted(self, request: Request, num_local: int, num_external: int) -> None:
        """Record the first admission's cache hits (device and store, by tier) and time."""
        tiers = self.connector.take_load_tiers(request.request_id)
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_local + num_external
            request.num_external_tokens = num_external
            request.external_tiers = tiers
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()

    def _num_external_tokens(self, request: Request, num_computed: int) -> tuple[int | None, bool]:
        """Tokens the connector can load after the device hit, leaving the last token
        to compute, and whether they load asynchronously; None: not known yet. A
        request that must compute its prompt itself (prompt logprobs) loads nothing."""
        if request.skip_reading_prefix_cache:
            return 0, False
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_computed)
        if num_external is None:
            return None, False
        num_external = max(min(num_external, request.num_tokens - 1 - num_computed), 0)
        return num_external, load_async and num_external > 0

    def _add_to_output(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        out.requests.append(request)
        out.num_new_tokens.append(num_new)
        out.start_positions.append(start)
        out.block_tables.append(self.kv.get_block_ids(request.request_id))
        out.sample.append(start + num_new == request.num_tokens)
        request.num_computed_tokens = start + num_new
        self.num_recomputed_tokens += max(min(start + num_new, request.peak_computed_tokens) - start, 0)
        request.peak_computed_tokens = max(request.peak_computed_tokens, start + num_new)

    def _jump_forward(self, request: Request) -> None:
        """Append the tokens the request's grammar forces next (the fixed head of a tool
        call, a schema's next key): the next step computes them in one go, where sampling
        them from masks that allow nothing else would take a step each. Not when logprobs
        are asked for, which forced tokens do not have. The forced run stops at max_tokens
        and after a stop token or EOS, so that `_stop_status` sees those last."""
        params = request.sampling_params
        if params.logprobs is not None:
            return
        forced = request.grammar.forced_tokens()[: params.max_tokens - request.num_output_tokens]
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
        for token_id in forced:
            request.append_output_token(token_id)
            if token_id in stops or request.error is not None:
                return

    def _extend_hashes(self, request: Request) -> None:
        """Hash the output blocks the newest tokens filled, if they filled any."""
        if request.num_tokens >= (len(request.block_hashes) + 1) * self.kv.block_size:
            self.block_hasher.extend(request.block_hashes, request.all_token_ids, request.cache_salt)

    def _stop_status(self, request: Request) -> RequestStatus | None:
        """Why the request stops after its newest token (vLLM's order: EOS, stop token
        ids, a completed grammar, length). max_model_len needs no check: add_request rejects any request whose
        prompt + max_tokens exceeds it."""
        token_id = request.output_token_ids[-1]
        params = request.sampling_params
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        if request.error is not None:  # the sampled token broke the request's grammar
            return RequestStatus.FINISHED_ERROR
        if request.grammar is not None and request.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.waiting.extendleft(reversed(self.forks.pop(request.request_id, [])))
        request.status = status
        request.finish_time = time.monotonic()
        del self.requests[request.request_id]
        self.groups.pop(request.request_id, None)
        self.connector.request_finished(request, self.kv.get_block_ids(request.request_id))
        self.kv.free(request)
