"""Blender: runs the requests whose prompts are segmented, from arrival to their handoff.

1. Segment prefills. Each segment but the last (the question) must have its KV,
   computed alone from position 0, in the device prefix cache. Such KV is exactly the
   KV of a prompt made of that segment alone, so its ordinary chained block hashes
   (the request's cache_salt in the first block, no other mark) name it: a segment
   missing from the device becomes an ordinary request of its tokens (one output
   token, discarded), which the scheduler batches with everything else, the connector
   loads from the store tiers when they hold it and saves to them when they do not.
   One segment prefill serves every request that waits for the same segment.
2. Blended prefill. Once its segment prefills are done, a request is admitted here
   (before the scheduler's step, so that nothing is allocated in between and the
   segments' cached blocks are still there): its exact prefix hit on the device stays
   exact, the segment blocks are held, the region after the hit is computed by
   `blend_prefill` into blocks of its own, all but the last prompt token.
3. Handoff. The request joins the scheduler's running requests with that KV computed;
   the next forward computes its last prompt token over the blended KV and samples,
   exactly as for a prefix hit, and it decodes like any request.

Segments not stored are computed alone first rather than in context, so a prompt's
blend does not depend on whether its documents were seen before, and its first sight
already stores every document for the next one. A segment evicted between its prefill
and the blend (memory pressure) is computed in context instead.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from connectors.base import SchedulerConnector
from engine.blend.forward import BlendPlan
from engine.blend.plan import (
    ReuseSources,
    blend_mark,
    blended_block_hashes,
    reusable_end,
    reuse_sources,
)
from engine.blend.segments import SegmentedTokens
from engine.block_pool import KVBlock
from engine.config import OFFLOAD_TIERS, EngineConfig
from engine.hashing import BlockHasher
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

if TYPE_CHECKING:  # the runner imports the blend forward, whose package imports this module
    from engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)

SEGMENT_ID_PREFIX = "\x00kv-segment-"  # segment prefill request ids; no client sends NUL
# where a reused segment's KV was when its request came: the device cache, a store tier
# (loaded by its segment prefill), or nowhere (computed by its segment prefill)
SOURCES = ("device", *OFFLOAD_TIERS, "computed")


@dataclass
class _SegmentPrefill:
    """An ordinary request computing (or loading) one segment alone."""

    request: Request
    waiters: set[str] = field(default_factory=set)


@dataclass
class _Waiting:
    """A segmented request waiting for its segment prefills."""

    request: Request
    tokens: SegmentedTokens
    segment_hashes: list[list[bytes]]  # per segment: its block hashes computed alone
    pending: set[bytes]  # keys of the segment prefills not finished yet
    prefills: dict[int, Request] = field(default_factory=dict)  # segment index -> its prefill
    probes: list[Future[int]] = field(default_factory=list)  # remote index probes out (`_probe`)


@dataclass(frozen=True)
class _Chain:
    """Block names a segmented prompt's KV may be held under, and how much of it is held:
    leading blocks on the device, then in the store after those."""

    hashes: list[bytes]
    exact: bool
    needed: int  # blocks up to the last one a blend could take segment KV for (`reusable_end`)
    on_device: int
    in_store: int


def _stored_chain(candidates: list[_Chain]) -> list[bytes] | None:
    """The names under which the device cache and the store together hold every needed
    block of the prompt, the store some of them: the exact prefix (an ordinary request of
    the same tokens was saved), or this blend's own blocks (the same segments in the same
    order, saved by an earlier blended request; their names do not depend on the
    question). As an ordinary request under those names the prompt loads them like a
    prefix hit and computes the rest in context, as a blend computes its question,
    without segment prefills or a blend. None: blend. The store answers from its
    in-memory metadata (what remote indexes know of comes in through `Blender._probe`)."""
    for candidate in candidates:
        if candidate.exact and candidate.on_device >= candidate.needed:
            return None  # the exact prefix is on the device: the blend hits it
        if candidate.on_device < candidate.needed <= candidate.on_device + candidate.in_store:
            return candidate.hashes
    return None


class Blender:
    """Reaches the engine through seams only: the KV-cache manager (lookup, hold and
    release of cached blocks, allocation), the scheduler (admission of the requests it
    hands over or starts), the connector's scheduler side (what the store holds) and the
    model runner (the blend forward, with its failure handling and device)."""

    def __init__(
        self, config: EngineConfig, runner: ModelRunner, kv: KVCacheManager, scheduler: Scheduler,
        connector: SchedulerConnector, block_hasher: BlockHasher,
    ) -> None:
        self.recompute_ratio = config.kv_blend_recompute_ratio
        self.enabled = config.enable_prefix_caching
        self.max_num_seqs = config.max_num_seqs
        self.runner = runner
        self.kv = kv
        self.scheduler = scheduler
        self.connector = connector
        self.hasher = block_hasher
        self.block_size = kv.block_size
        self.waiting: dict[str, _Waiting] = {}
        self.prefills: dict[bytes, _SegmentPrefill] = {}
        self._ids = itertools.count()
        self.counters: Counter[str] = Counter()

    # ---- requests -------------------------------------------------------------------------

    def accepts(self, token_ids: object) -> bool:
        """Whether a prompt is blended: segmented, with at least one segment before the
        question, and the device prefix cache on (it holds the segments)."""
        return self.enabled and isinstance(token_ids, SegmentedTokens) and len(token_ids.starts) > 1

    def add(self, request: Request, tokens: SegmentedTokens) -> bool:
        """Take a segmented request; False (nothing taken) when it runs as an ordinary
        request instead: the pool could never hold its segments beside its own blocks, or
        the store holds the KV a blend would reuse under names of this prompt (its
        `block_hashes` are then set to them, see `_stored_chain`). Raises
        RequestTooLongError as the scheduler would."""
        self.scheduler.validate(request)
        if 2 * cdiv(request.num_prompt_tokens, self.block_size) > self.kv.num_blocks:
            return False
        candidates = self._candidate_chains(request, tokens)
        if self._serve_stored(request, candidates):
            return False
        segment_hashes = [self.hasher.hashes(tokens[a:b], request.cache_salt) for a, b in tokens.bounds]
        waiting = _Waiting(request, tokens, segment_hashes, set())
        self.waiting[request.request_id] = waiting
        waiting.probes = self._probe(candidates)
        if not waiting.probes:
            self._start_segment_prefills(waiting)
        return True

    def abort(self, request_ids: Iterable[str]) -> None:
        for request_id in request_ids:
            waiting = self.waiting.pop(request_id, None)
            if waiting is not None:
                self._release_prefills(waiting)

    def has_waiting(self) -> bool:
        return bool(self.waiting)

    def wait_for_probes(self, timeout_s: float) -> None:
        """Block until a remote index probe of a waiting request completes, or
        `timeout_s`; return at once when none is out."""
        probes = [f for waiting in self.waiting.values() for f in waiting.probes]
        if probes:
            concurrent.futures.wait(probes, timeout_s, concurrent.futures.FIRST_COMPLETED)

    def stats(self) -> dict[str, int]:
        """`kv_blend_*` counters: blended requests and their prompt tokens; segmented
        requests served from the store instead (`_stored_chain`); tokens from
        the exact (or same-blend) prefix hit; tokens that kept their moved segment KV,
        in all and by where the segment was when the request came (`SOURCES`: the
        device cache, the store tier its segment prefill loaded it from, or computed by
        that prefill); tokens computed in context; segment prefills run."""
        keys = ["kv_blend_requests", "kv_blend_stored_requests", "kv_blend_prompt_tokens", "kv_blend_prefix_hit_tokens",
                "kv_blend_reused_tokens", *(f"kv_blend_reused_tokens_{s}" for s in SOURCES),
                "kv_blend_recomputed_tokens", "kv_blend_segment_prefills"]
        return {key: self.counters[key] for key in keys}

    # ---- the step ---------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Blend the requests whose segment prefills are done (in arrival order, while a
        seat and blocks are free) and hand them to the scheduler; returns those whose
        blend failed, finished with their error."""
        self._collect_prefills()
        self._collect_probes()
        failed = []
        for request_id, waiting in list(self.waiting.items()):
            if waiting.pending or waiting.probes:
                continue
            if self.scheduler.num_running + self.scheduler.num_loading >= self.max_num_seqs:
                break
            try:
                if not self._admit(waiting):
                    break
            except Exception as exc:  # one bad request must not take the engine down
                logger.exception("blended prefill of %s failed", request_id)
                self.kv.free(waiting.request)
                self._finish_failed(waiting.request, f"{type(exc).__name__}: {exc}")
                failed.append(waiting.request)
            del self.waiting[request_id]
        return failed

    def _admit(self, waiting: _Waiting) -> bool:
        """Blend one request and hand it over; False (nothing changed) when the pool
        cannot hold its blocks now."""
        request, tokens = waiting.request, waiting.tokens
        bs = self.block_size
        exact = self.hasher.hashes(request.prompt_token_ids, request.cache_salt)
        mark = blend_mark(self.recompute_ratio, tokens.starts)
        request.block_hashes = blended_block_hashes(
            exact, self._exact_hit(request, exact), request.prompt_token_ids, bs, self.hasher.seed,
            request.cache_salt, mark)
        hits = self.kv.hit_blocks(request.block_hashes[: self._loadable_blocks(request)])
        start, end = len(hits) * bs, request.num_prompt_tokens - 1
        held: list[KVBlock] = []

        def stored_block(segment: int, block: int) -> int | None:
            found = self.kv.cached_block(waiting.segment_hashes[segment][block])
            if found is not None:
                held.append(found)
            return None if found is None else found.block_id

        sources = reuse_sources(tokens.bounds, (start, end), bs, stored_block)
        self.kv.hold(held)  # so that allocating the region cannot evict them
        try:
            if self.kv.allocate_slots(request, 0, hits, end - start) is None:
                return False
            recomputed = self._blend(request, start, end, sources)
        finally:
            self.kv.release(held)
        reused, loaded = self._count(waiting, start, sources, recomputed)
        self.counters["kv_blend_requests"] += 1
        self.counters["kv_blend_prompt_tokens"] += request.num_prompt_tokens
        self.counters["kv_blend_prefix_hit_tokens"] += start
        self.counters["kv_blend_recomputed_tokens"] += end - start - reused + 1  # + the last token
        request.num_computed_tokens = end
        request.num_cached_tokens = loaded
        request.first_scheduled_time = request.first_scheduled_time or time.monotonic()
        self.scheduler.add_running(request)
        return True

    def _blend(self, request: Request, start: int, end: int, sources: ReuseSources) -> list[int]:
        """Compute positions start .. end-1 into the request's blocks (through the model
        runner); the region rows computed in context."""
        if end <= start:
            return []
        device = self.runner.device
        table = torch.tensor(self.kv.get_block_ids(request.request_id), dtype=torch.long)
        positions = torch.arange(end)
        slots = table[positions // self.block_size] * self.block_size + positions % self.block_size
        plan = BlendPlan(
            token_ids=torch.tensor(request.prompt_token_ids[start:end], dtype=torch.long, device=device),
            positions_cpu=positions[start:],
            context_slots=slots[:start].to(device),
            dest_slots=slots[start:].to(device),
            reuse_slots=torch.tensor(sources.slots, dtype=torch.long, device=device),
            reuse_shift=torch.tensor(sources.shifts, dtype=torch.long, device=device),
            recompute_ratio=self.recompute_ratio,
        )
        return self.runner.blend(plan)

    # ---- segment prefills -------------------------------------------------------------------

    def _start_segment_prefills(self, waiting: _Waiting) -> None:
        """Prefill every segment the device cache lacks (but for those inside the exact
        prefix hit, which need nothing)."""
        request, tokens = waiting.request, waiting.tokens
        bounds = tokens.bounds
        exact_end = self._exact_hit(request) * self.block_size
        for index, hashes in enumerate(waiting.segment_hashes[:-1]):
            if bounds[index][1] > exact_end and hashes and not all(self._cached(h) for h in hashes):
                waiting.prefills[index] = self._segment_prefill(waiting, hashes[-1], tokens, bounds[index])

    def _collect_probes(self) -> None:
        """Requests whose remote index probes are all in: served from the store if it
        holds their KV after all, else on to their segment prefills."""
        for request_id, waiting in list(self.waiting.items()):
            if not waiting.probes or not all(f.done() for f in waiting.probes):
                continue
            waiting.probes = []
            if self._serve_stored(waiting.request, self._candidate_chains(waiting.request, waiting.tokens)):
                del self.waiting[request_id]
                self.scheduler.add_request(waiting.request)
            else:
                self._start_segment_prefills(waiting)

    def _segment_prefill(
        self, waiting: _Waiting, key: bytes, tokens: SegmentedTokens, bounds: tuple[int, int]
    ) -> Request:
        """The prefill of one segment alone, started unless one is running already."""
        prefill = self.prefills.get(key)
        if prefill is None:
            parent = waiting.request
            child = Request(
                request_id=f"{SEGMENT_ID_PREFIX}{next(self._ids)}",
                prompt_token_ids=list(tokens[bounds[0] : bounds[1]]),
                sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                cache_salt=parent.cache_salt,
                arrival_time=parent.arrival_time,
            )
            self.scheduler.add_request(child)
            prefill = self.prefills[key] = _SegmentPrefill(child)
            self.counters["kv_blend_segment_prefills"] += 1
        prefill.waiters.add(waiting.request.request_id)
        waiting.pending.add(key)
        return prefill.request

    def _collect_prefills(self) -> None:
        """Release the requests waiting on segment prefills that finished (however)."""
        for key, prefill in list(self.prefills.items()):
            if not prefill.request.is_finished:
                continue
            del self.prefills[key]
            for request_id in prefill.waiters:
                waiting = self.waiting.get(request_id)
                if waiting is not None:
                    waiting.pending.discard(key)

    def _release_prefills(self, waiting: _Waiting) -> None:
        """An aborted request no longer waits; a prefill nobody waits for is aborted."""
        for key in waiting.pending:
            prefill = self.prefills.get(key)
            if prefill is None:
                continue
            prefill.waiters.discard(waiting.request.request_id)
            if not prefill.waiters:
                del self.prefills[key]
                self.scheduler.abort_requests([prefill.request.request_id])

    # ---- helpers ------------------------------------------------------------------------------

    def _serve_stored(self, request: Request, candidates: list[_Chain]) -> bool:
        """Whether the request runs as an ordinary request under the names of KV the store
        holds for it (`_stored_chain`); its `block_hashes` are then set to them."""
        chain = _stored_chain(candidates)
        if chain is None:
            return False
        request.block_hashes = chain
        self.counters["kv_blend_stored_requests"] += 1
        return True

    def _probe(self, candidates: list[_Chain]) -> list[Future[int]]:
        """Ask the remote tiers' block indexes about the blocks of each candidate chain
        that memory does not know of (another instance may have saved them)."""
        probes = []
        for candidate in candidates:
            held = candidate.on_device + candidate.in_store
            if held < candidate.needed:
                probe = self.connector.probe_stored_blocks(candidate.hashes, held, candidate.needed)
                if probe is not None:
                    probes.append(probe)
        return probes

    def _candidate_chains(self, request: Request, tokens: SegmentedTokens) -> list[_Chain]:
        """The names under which the device cache and the store may hold the KV a blend of
        this prompt would reuse (none when it would reuse nothing): the exact chain, then
        the blend's marked chain as an earlier blend would have named it, marked after
        its exact device hit, which is at least the first segment's blocks (its prefill
        computed them), more where the exact prefix held more."""
        bs = self.block_size
        loadable = self._loadable_blocks(request)
        needed = min(loadable, cdiv(reusable_end(tokens.bounds, bs), bs))
        if needed == 0:
            return []
        exact = self.hasher.hashes(request.prompt_token_ids, request.cache_salt)
        candidates = [_Chain(exact, True, needed, *self._held(exact, loadable))]
        mark = blend_mark(self.recompute_ratio, tokens.starts)
        exact_held = candidates[0].on_device + candidates[0].in_store
        for num_exact in sorted({tokens.bounds[0][1] // bs, exact_held}):
            chain = blended_block_hashes(exact, num_exact, request.prompt_token_ids, bs, self.hasher.seed,
                                         request.cache_salt, mark)
            candidates.append(_Chain(chain, False, needed, *self._held(chain, loadable)))
        return candidates

    def _held(self, chain: list[bytes], loadable: int) -> tuple[int, int]:
        """Leading blocks of `chain` (up to `loadable`) in the device cache, then how many
        after those the store holds."""
        on_device = len(self.kv.hit_blocks(chain[:loadable]))
        return on_device, self.connector.num_stored_blocks(chain, on_device, loadable)

    def _cached(self, block_hash: bytes) -> bool:
        return self.kv.cached_block(block_hash) is not None

    def _loadable_blocks(self, request: Request) -> int:
        """Whole blocks before the prompt's last token (which is always computed)."""
        return (request.num_prompt_tokens - 1) // self.block_size

    def _exact_hit(self, request: Request, exact: list[bytes] | None = None) -> int:
        """Blocks of the prompt's exact prefix in the device cache."""
        if exact is None:
            exact = self.hasher.hashes(request.prompt_token_ids, request.cache_salt)
        return len(self.kv.hit_blocks(exact[: self._loadable_blocks(request)]))


    def _count(self, waiting: _Waiting, start: int, sources: ReuseSources, recomputed: list[int]) -> tuple[int, int]:
        """Count the tokens that kept their moved KV, by where their segment's KV was
        when the request came; returns their number, and how many of the prompt's tokens
        had their KV loaded (its prefix hit of `start` tokens and those kept) rather than
        computed by its own segment prefills: its cached tokens, which must not call
        computed work a hit (a segment prefill computes the first segment's blocks under
        the prompt's exact hashes, so they are in its prefix hit too)."""
        kept = [row for row, slot in enumerate(sources.slots) if slot >= 0]
        kept = sorted(set(kept) - set(recomputed))
        loaded = start
        for index, prefill in waiting.prefills.items():
            seg_start, seg_end = waiting.tokens.bounds[index]
            loaded -= sum(_source(prefill, offset) == "computed" for offset in range(min(seg_end, start) - seg_start))
        for row in kept:
            source = _source(waiting.prefills.get(sources.segments[row]), sources.offsets[row])
            self.counters[f"kv_blend_reused_tokens_{source}"] += 1
            loaded += source != "computed"
        self.counters["kv_blend_reused_tokens"] += len(kept)
        return len(kept), loaded

    def _finish_failed(self, request: Request, message: str) -> None:
        request.error = message
        request.status = RequestStatus.FINISHED_ERROR
        request.finish_time = time.monotonic()


def _source(prefill: Request | None, offset: int) -> str:
    """Where the KV of a segment's token at `offset` was when its blended request came:
    on the device (no segment prefill, or inside its device hit), in the store tier its
    prefill loaded it from, or nowhere (computed by the prefill)."""
    if prefill is None:
        return "device"
    position = prefill.num_cached_tokens - prefill.num_external_tokens  # the prefill's device hit
    if offset < position:
        return "device"
    for tier, tokens in prefill.external_tiers:
        position += tokens
        if offset < position:
            return tier
    return "computed"
