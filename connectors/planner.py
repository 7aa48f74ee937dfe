"""The scheduler side of the store connector: what to load and what to save.

Plain Python over the store's manager (the `StoreIndex` protocol, which
kvstore.manager.StoreManager satisfies: answers from the in-memory index), and the
store's transfers for opening and giving back loads and prefetches (the `LoadOpener`
protocol, kvstore.transfers.Transfers); it imports neither torch nor the store, moves
no bytes and waits on nothing. One `RequestKV` per request holds everything the connector keeps
about it: its save cursor, whether its prompt's tail record is handled, the probe and
prefetch it started, and the load it opened.

Geometry. Block b of a request belongs to chunk `b // B` (B blocks per chunk). Record j
of a request holds its blocks `[j*B, min((j+1)*B, n))`: a full record once the chunk's
blocks are all computed, or the prompt's tail record (its full blocks past the last
chunk boundary) once its prefill is done. Loads are per block: the run of blocks from
the first one not on the device up to the loadable end (whole blocks, never the last
token), wherever the records holding them were cut.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from connectors.base import ConnectorRequest, ScheduledBatch


class OpenLoad(Protocol):
    """A load the store opened (kvstore.transfers.Load)."""

    @property
    def num_blocks(self) -> int: ...

    def done(self) -> bool: ...

    @property
    def futures(self) -> list[Future[None]]: ...

    @property
    def deadline(self) -> float: ...

    def arrived_blocks(self) -> int: ...

    @property
    def blocked(self) -> bool: ...

    def start(self) -> None: ...

    def tier_runs(self, num_blocks: int) -> list[tuple[str, int]]: ...


class Pending(Protocol):
    """Work of the store's pools the planner waits for (a prefetch: kvstore.loading.ReadBatch)."""

    futures: list[Future[None]]
    deadline: float

    def done(self) -> bool: ...


class StoreIndex(Protocol):
    """What the planner asks the store's manager (kvstore.manager.StoreManager), from
    memory only."""

    @property
    def has_remote_index(self) -> bool: ...

    def poll(self) -> None: ...

    def locate(self, block_hashes: Sequence[bytes], start: int, end: int) -> Sequence[Any]: ...

    def probe(self, block_hashes: Sequence[bytes], start: int, end: int) -> Future[int] | None: ...

    def record_name(self, block_hash: bytes) -> str: ...

    def has_record(self, name: str) -> bool: ...


class LoadOpener(Protocol):
    """How the planner opens and gives back the loads and prefetches of located runs
    (kvstore.transfers.Transfers): the slots are the manager's choice, the reads start
    when the load does."""

    def open_load(self, run: Sequence[Any], start: bool = True) -> OpenLoad: ...

    def close_load(self, load: Any) -> None: ...

    def prefetch_run(self, run: Sequence[Any]) -> Pending | None: ...


@dataclass(frozen=True)
class ChunkGeometry:
    block_size: int
    chunk_tokens: int

    @property
    def blocks_per_chunk(self) -> int:
        return self.chunk_tokens // self.block_size

    def loadable_blocks(self, num_tokens: int) -> int:
        """Blocks [0, n) may come from a store: whole blocks, never the last token (its
        forward pass yields the logits to sample from)."""
        return (num_tokens - 1) // self.block_size

    def tail(self, num_full_blocks: int) -> range | None:
        """The blocks of the tail record ending at `num_full_blocks`, None at a chunk
        boundary (a full record ends there, or nothing does)."""
        start = num_full_blocks // self.blocks_per_chunk * self.blocks_per_chunk
        return range(start, num_full_blocks) if start < num_full_blocks else None


@dataclass(frozen=True)
class SavePlan:
    """Save blocks [first_block, first_block + len(block_ids)) of a request, whose
    hashes are `block_hashes`, from device blocks `block_ids`."""

    first_block: int
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(eq=False)
class PlannedLoad:
    """A load opened for a request at admission: blocks from `start_block` on, into
    device blocks `block_ids` once the request is allocated."""

    request_id: str
    start_block: int
    load: OpenLoad
    is_async: bool
    promised_blocks: int
    block_ids: list[int] = field(default_factory=list)
    dropped: bool = False  # never to write the device cache


@dataclass
class StepMeta:
    """The worker's work of one step: records to copy out first (a preempted request's,
    before any forward overwrites its freed blocks), loads to copy in before the forward,
    records to copy out after it."""

    offloads: list[SavePlan] = field(default_factory=list)
    loads: list[PlannedLoad] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass(eq=False)
class RequestKV:
    request_id: str
    saved_chunks: int = 0  # full chunks before this one were saved or found stored
    tail_handled: bool = False  # the prompt's tail record was saved or found stored
    probe: Future[int] | None = None
    probed: bool = False
    prefetch: Pending | None = None
    prefetched: bool = False
    load: PlannedLoad | None = None  # opened at admission, not yet handed to the worker


@dataclass
class PlannerCounters:
    async_loads: int = 0
    load_failures: int = 0  # loads that delivered fewer blocks than promised
    load_failed_tokens: int = 0  # promised tokens recomputed instead
    prefetched_requests: int = 0


class Planner:
    """`loads` and `saves` say which half of the store this instance uses (its kv_role:
    a producer never loads, a consumer never saves)."""

    def __init__(self, manager: StoreIndex, opener: LoadOpener, geometry: ChunkGeometry, save_decode: bool, *,
                 loads: bool = True, saves: bool = True) -> None:
        self.manager = manager
        self.opener = opener
        self.geometry = geometry
        self.save_decode = save_decode
        self.loads, self.saves = loads, saves
        self.counters = PlannerCounters()
        self.requests: dict[str, RequestKV] = {}
        self.loading: dict[str, PlannedLoad] = {}  # admitted, asynchronous, not yet done
        self.ready: list[PlannedLoad] = []  # to copy in before the next forward
        self.offloads: list[SavePlan] = []
        self.abandoned: list[OpenLoad] = []  # dropped before done: closed once done
        self.load_tiers: dict[str, list[tuple[str, int]]] = {}  # take_load_tiers

    # ---- admission --------------------------------------------------------------------------

    def match(self, request: ConnectorRequest, num_computed: int) -> tuple[int | None, bool]:
        """Tokens the store supplies after a device hit of `num_computed` tokens and
        whether they arrive asynchronously; None while a probe or prefetch of this request
        is still out, or another request reads a record it needs (ask again next step)."""
        if not self.loads:
            return 0, False
        state = self._state(request.request_id)
        bs = self.geometry.block_size
        start, end = num_computed // bs, self.geometry.loadable_blocks(request.num_tokens)
        planned = state.load
        if planned is not None and planned.start_block != start:
            self._drop(planned)
            planned = state.load = None
        if planned is None:
            if start >= end:
                return 0, False
            if self._waiting(state, request, start, end):
                return None, False
            run = self.manager.locate(request.block_hashes, start, end)
            if not run:
                return 0, False
            # Its reads begin once the worker knows where its blocks go (see start_loads).
            load = self.opener.open_load(run, start=False)
            if load.blocked:  # another request is reading a record of the run: wait for it
                self._close_later(load)
                return None, False
            is_async = not load.done()  # read once: it may complete meanwhile
            promised = load.num_blocks
            if not is_async:  # a synchronous answer is exact: only what arrived
                promised = load.arrived_blocks()
                self._count_shortfall(load.num_blocks - promised)
            if promised == 0:
                self._close_later(load)
                return 0, False
            planned = state.load = PlannedLoad(request.request_id, start, load, is_async, promised)
        return planned.promised_blocks * bs, planned.is_async

    def allocated(self, request: ConnectorRequest, block_ids: list[int], num_external: int,
                  before_reads: Callable[[PlannedLoad], None] | None = None) -> None:
        """The request was admitted with `block_ids` as its table and `num_external`
        tokens to come from the store right after its device hit. An asynchronous load's
        reads begin here, after `before_reads(planned load)` (the worker offering them
        their device blocks)."""
        state = self._state(request.request_id)
        state.prefetched = True  # admitted: no prefetch for it any more
        planned, state.load = state.load, None
        if planned is None:
            return
        blocks = num_external // self.geometry.block_size
        if blocks <= 0:
            self._drop(planned)
            return
        planned.promised_blocks = min(planned.promised_blocks, blocks)
        planned.block_ids = block_ids[planned.start_block : planned.start_block + planned.promised_blocks]
        if planned.is_async:
            self.loading[request.request_id] = planned
            self.counters.async_loads += 1
            if before_reads is not None:
                before_reads(planned)
            planned.load.start()
        else:
            self.ready.append(planned)
            self._note_tiers(planned)

    def finished_loads(self) -> dict[str, int]:
        """Asynchronous loads that are done: {request id: tokens that arrived}, the
        leading run of blocks; the rest is recomputed. Their copies go to the next step."""
        done: dict[str, int] = {}
        for request_id, planned in list(self.loading.items()):
            if not planned.load.done():
                continue
            del self.loading[request_id]
            arrived = min(planned.promised_blocks, planned.load.arrived_blocks())
            self._count_shortfall(planned.promised_blocks - arrived)
            planned.promised_blocks = arrived
            self.ready.append(planned)
            self._note_tiers(planned)
            done[request_id] = arrived * self.geometry.block_size
        return done

    def prefetch(self, requests: Sequence[ConnectorRequest]) -> None:
        """Queued requests: probe remote indexes early, pull lower-tier records into cpu."""
        if not self.loads:
            return
        for request in requests:
            state = self._state(request.request_id)
            end = self.geometry.loadable_blocks(request.num_tokens)
            self._waiting(state, request, 0, end)
            if state.prefetched or state.probe is not None:
                continue
            state.prefetched = True
            run = self.manager.locate(request.block_hashes, 0, end)
            state.prefetch = self.opener.prefetch_run(run)
            if state.prefetch is not None:
                self.counters.prefetched_requests += 1

    # ---- saves ------------------------------------------------------------------------------

    def build(self, output: ScheduledBatch) -> StepMeta:
        self.manager.poll()  # what loads found missing is saved again
        self.start_loads()
        meta = StepMeta(offloads=self.offloads, loads=[p for p in self.ready if not p.dropped])
        self.offloads, self.ready = [], []
        for request, block_ids in zip(output.requests, output.block_tables, strict=True):
            meta.saves += self._completed(request, block_ids)
        return meta

    def start_loads(self) -> None:
        """Begin the reads of the loads opened for requests not admitted (a load is
        opened unstarted so that, if its request is admitted, the worker can first offer
        its reads their device blocks: `allocated`)."""
        for state in self.requests.values():
            if state.load is not None:
                state.load.load.start()

    def preempted(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        """Plan saving what the victim computed and the store lacks: its full chunks and
        the tail of its full blocks (copied out before the next forward)."""
        computed = request.num_computed_tokens
        uncopied = [p for p in self.ready if p.request_id == request.request_id and not p.dropped]
        if uncopied:  # loaded blocks not in the device cache yet are not its KV
            computed = min(computed, uncopied[0].start_block * self.geometry.block_size)
        self.forget(request.request_id)
        full_blocks = min(computed // self.geometry.block_size, len(request.block_hashes))
        per = self.geometry.blocks_per_chunk
        plans = [self._plan(request, block_ids, c * per, (c + 1) * per) for c in range(full_blocks // per)]
        tail = self.geometry.tail(full_blocks)
        if tail is not None:
            plans.append(self._plan(request, block_ids, tail.start, tail.stop))
        self.offloads += [p for p in plans if p is not None]

    def take_load_tiers(self, request_id: str) -> list[tuple[str, int]]:
        """(tier, tokens) runs of the request's last settled load, in prompt order; []
        when none (read once, at admission)."""
        return self.load_tiers.pop(request_id, [])

    def forget(self, request_id: str) -> None:
        """The request left (finished, aborted, preempted): drop everything about it."""
        self.load_tiers.pop(request_id, None)
        state = self.requests.pop(request_id, None)
        if state is not None and state.load is not None:
            self._drop(state.load)
        planned = self.loading.pop(request_id, None)
        if planned is not None:
            self._drop(planned)
        for planned in self.ready:
            if planned.request_id == request_id:
                self._drop(planned)

    # ---- internals --------------------------------------------------------------------------

    def _waiting(self, state: RequestKV, request: ConnectorRequest, start: int, end: int) -> bool:
        """Whether the request waits on its probe or prefetch; starts the probe of the
        blocks past what memory knows, once per request."""
        if state.probe is not None or state.prefetch is not None:
            # What they found reaches the index when the store polls: apply it before the
            # index is read, or a finished probe looks like a miss (polling also gives up
            # on a probe past its time).
            self.manager.poll()
        if state.probe is not None and state.probe.done():
            state.probe = None
        if state.prefetch is not None and state.prefetch.done():
            state.prefetch = None
        if not state.probed and start < end and self.manager.has_remote_index:
            state.probed = True
            known = len(self.manager.locate(request.block_hashes, start, end))
            state.probe = self.manager.probe(request.block_hashes, start + known, end)
        return state.probe is not None or state.prefetch is not None

    def _completed(self, request: ConnectorRequest, block_ids: list[int]) -> list[SavePlan]:
        """Records the step completes for `request` that the store does not hold."""
        if not self.saves:
            return []
        state = self._state(request.request_id)
        computed = request.num_computed_tokens
        if not self.save_decode:
            computed = min(computed, request.num_prompt_tokens)
        per = self.geometry.blocks_per_chunk
        full_blocks = min(computed // self.geometry.block_size, len(request.block_hashes))
        plans = []
        for chunk in range(state.saved_chunks, full_blocks // per):
            plans.append(self._plan(request, block_ids, chunk * per, (chunk + 1) * per))
        state.saved_chunks = max(state.saved_chunks, full_blocks // per)
        if not state.tail_handled and request.num_computed_tokens >= request.num_prompt_tokens:
            state.tail_handled = True
            prompt_blocks = min(request.num_prompt_tokens // self.geometry.block_size, len(request.block_hashes))
            tail = self.geometry.tail(prompt_blocks)
            if tail is not None:
                plans.append(self._plan(request, block_ids, tail.start, tail.stop))
        return [p for p in plans if p is not None]

    def _plan(self, request: ConnectorRequest, block_ids: list[int], first: int, end: int) -> SavePlan | None:
        """A save of blocks [first, end) unless the store holds that record."""
        hashes = tuple(request.block_hashes[first:end])
        if self.manager.has_record(self.manager.record_name(hashes[-1])):
            return None
        return SavePlan(first, hashes, tuple(block_ids[first:end]))

    def _state(self, request_id: str) -> RequestKV:
        state = self.requests.get(request_id)
        if state is None:
            state = self.requests[request_id] = RequestKV(request_id)
        return state

    def _note_tiers(self, planned: PlannedLoad) -> None:
        bs = self.geometry.block_size
        runs = planned.load.tier_runs(planned.promised_blocks)
        self.load_tiers[planned.request_id] = [(tier, blocks * bs) for tier, blocks in runs]

    def _drop(self, planned: PlannedLoad) -> None:
        if planned.dropped:
            return
        planned.dropped = True
        self._close_later(planned.load)

    def _close_later(self, load: OpenLoad) -> None:
        """Give back a load that will not reach the device: now if its reads are done
        (its slots, reserved under its records' names, are free for saves of them at
        once), else once they are (`close_abandoned`)."""
        load.start()
        if load.done():
            self.opener.close_load(load)
        else:
            self.abandoned.append(load)

    def close_abandoned(self) -> None:
        still = []
        for load in self.abandoned:
            if load.done():
                self.opener.close_load(load)
            else:
                still.append(load)
        self.abandoned = still

    def _count_shortfall(self, missing_blocks: int) -> None:
        if missing_blocks > 0:
            self.counters.load_failures += 1
            self.counters.load_failed_tokens += missing_blocks * self.geometry.block_size
