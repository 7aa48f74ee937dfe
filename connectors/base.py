"""The connector interface between the engine and a KV store (DESIGN.md, Connector
interface), and the null connector the engine uses when no store is configured.

Roles, as in vLLM's KV connector v1:

- scheduler side: decides what to load and save, from in-memory metadata only.
  `get_num_new_matched_tokens` at admission, `update_state_after_alloc` once the
  request's blocks exist, `build_meta` once per step, `request_preempted` /
  `request_finished` when a request leaves the running set, `prefetch` for requests
  still queued, `get_finished()` at the start of every schedule (which asynchronous
  loads completed, and how many tokens each delivered).
- worker side: moves the bytes. `start_load_kv(meta)` before the step's forward,
  `wait_for_save()` after it, `wait_for_loads` when the engine has nothing to run but
  requests waiting on the store.
- admin side: pin, unpin, flush, stats and close, for the engine's admin methods.

DESIGN.md's layer-wise hooks (`wait_for_layer_load`, `save_kv_layer`) are not part of
this interface: loads complete before the forward and saves copy whole blocks after it
(one copy per run of blocks, see docs/ARCHITECTURE.md).

The engine is single-process, so one object plays every role; the split keeps the
device work (worker side) out of the scheduling decisions.

Requests and batches are described structurally (`ConnectorRequest`, `ScheduledBatch`)
so that this package does not import the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from typing import Protocol

from kvstore.index import IndexListener


class KVStoreNotConfiguredError(RuntimeError):
    """A store operation (pin, unpin, flush, store stats) on an engine without --kv-offload."""


class ConnectorConfigError(ValueError):
    """Store options that cannot work (too small a cpu tier, an unusable directory...);
    `option` names the kvstore.StoreConfig field when one is to blame."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class ConnectorRequest(Protocol):
    """What a connector reads of a request (engine.request.Request satisfies it)."""

    request_id: str
    block_hashes: list[bytes]
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...


class ScheduledBatch(Protocol):
    """What `build_meta` reads of a step (engine.scheduler.SchedulerOutput satisfies it).
    Request i computed up to its `num_computed_tokens` in blocks `block_tables[i]`."""

    requests: list
    block_tables: list[list[int]]


FinishedLoads = dict[str, int]
"""{request id: tokens loaded} of the asynchronous loads that completed."""


class SchedulerConnector(Protocol):
    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond the device hit of `num_computed_tokens` that the store can
        supply, and whether they arrive asynchronously (the request then waits in
        WAITING_FOR_REMOTE_KV and the true count comes from `get_finished`). For a
        synchronous answer the count is exact: those tokens will be in the device
        blocks before the next forward. None: not known yet (the store is still finding
        out, asynchronously); the scheduler leaves the request waiting and asks again."""
        ...

    def num_stored_blocks(self, block_hashes: Sequence[bytes], start: int, end: int) -> int:
        """How many of blocks `start..end-1` of a sequence, from `start` on, the store
        holds as far as its in-memory metadata knows (no I/O): a load planned now would
        ask for them."""
        ...

    def probe_stored_blocks(self, block_hashes: Sequence[bytes], start: int, end: int) -> Future[int] | None:
        """Ask the remote tiers' block indexes about blocks `start..end-1`: once the
        future is done, `num_stored_blocks` knows what they know. None: nothing to ask."""
        ...

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request was admitted with `block_ids` as its whole block table; the
        external tokens go right after the device hit."""
        ...

    def build_meta(self, output: ScheduledBatch) -> object:
        """The worker-side work of this step (`SchedulerOutput.connector_meta`)."""
        ...

    def take_load_tiers(self, request_id: str) -> list[tuple[str, int]]:
        """(tier, tokens) runs, in prompt order, of the external tokens of the request's
        last admitted load (right after its device hit); [] when it loaded none. Read
        once, when the scheduler admits the request (the runs are then forgotten)."""
        ...

    def request_preempted(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        """Offload mode: called before a preempted request's blocks are freed."""
        ...

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        """The request finished (or was aborted); its blocks are freed right after. What
        it computed was copied out in its last step."""
        ...

    def prefetch(self, requests: Sequence[ConnectorRequest]) -> None:
        """These requests are still queued: start pulling their chunks closer."""
        ...

    def get_finished(self) -> FinishedLoads: ...


class WorkerConnector(Protocol):
    def start_load_kv(self, meta: object) -> None: ...

    def wait_for_save(self) -> None:
        """Copy this step's completed chunks out of the device cache; returns once the
        device blocks may be overwritten, never waiting on disk or network I/O."""
        ...

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until something a waiting request needs from the store completes (a load,
        a lookup) or `timeout_s` passes."""
        ...


class KVConnector(SchedulerConnector, WorkerConnector, Protocol):
    """Every role, plus the admin side the engine's kv_* methods call."""

    def stats(self) -> dict[str, int | float]:
        """Flat counters (`kv_*` names) merged into LLMEngine.stats()."""
        ...

    def tier_stats(self) -> dict[str, dict]: ...

    def tier_health(self) -> dict[str, str]: ...

    def pin(self, block_hashes: Sequence[bytes], ttl_s: float | None) -> tuple[int, int]:
        """Pin the chunks of a sequence's full blocks: (chunks pinned, of them stored now)."""
        ...

    def unpin(self, block_hashes: Sequence[bytes]) -> int: ...

    def flush(self, tiers: Sequence[str] | None) -> Future[dict[str, int]]:
        """Start a flush (TieredStore.flush): returns at once, the count per tier to come."""
        ...

    def make_resident(self) -> None:
        """Fault in the store's host memory now, so that no step pays for a first touch
        (a server calls it once at start, before it takes traffic)."""
        ...

    def watch_blocks(self, listener: IndexListener) -> None:
        """Tell `listener` of the records the store's tiers hold, and of every record they
        gain and lose from now on."""
        ...

    def stored_blocks_in(self, block_hashes: Sequence[bytes], tier: str) -> int:
        """How many leading blocks of a sequence `tier` holds, as far as the store knows
        once it has applied what its tiers reported (no I/O)."""
        ...

    def close(self) -> None: ...


class NullConnector:
    """No store: nothing to load or save; admin calls raise KVStoreNotConfiguredError."""

    def get_num_new_matched_tokens(
        self, request: ConnectorRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def num_stored_blocks(self, block_hashes: Sequence[bytes], start: int, end: int) -> int:
        return 0

    def probe_stored_blocks(self, block_hashes: Sequence[bytes], start: int, end: int) -> Future[int] | None:
        return None

    def update_state_after_alloc(
        self, request: ConnectorRequest, block_ids: list[int], num_external_tokens: int
    ) -> None:
        return None

    def build_meta(self, output: ScheduledBatch) -> object:
        return None

    def take_load_tiers(self, request_id: str) -> list[tuple[str, int]]:
        return []

    def request_preempted(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        return None

    def request_finished(self, request: ConnectorRequest, block_ids: list[int]) -> None:
        return None

    def prefetch(self, requests: Sequence[ConnectorRequest]) -> None:
        return None

    def get_finished(self) -> FinishedLoads:
        return {}

    def start_load_kv(self, meta: object) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def wait_for_loads(self, timeout_s: float) -> None:
        return None

    def stats(self) -> dict[str, int | float]:
        return {}

    def tier_stats(self) -> dict[str, dict]:
        raise KVStoreNotConfiguredError("no KV store is configured (--kv-offload)")

    def tier_health(self) -> dict[str, str]:
        return {}

    def pin(self, block_hashes: Sequence[bytes], ttl_s: float | None) -> tuple[int, int]:
        raise KVStoreNotConfiguredError("no KV store is configured (--kv-offload)")

    def unpin(self, block_hashes: Sequence[bytes]) -> int:
        raise KVStoreNotConfiguredError("no KV store is configured (--kv-offload)")

    def flush(self, tiers: Sequence[str] | None) -> Future[dict[str, int]]:
        raise KVStoreNotConfiguredError("no KV store is configured (--kv-offload)")

    def make_resident(self) -> None:
        return None

    def watch_blocks(self, listener: IndexListener) -> None:
        return None

    def stored_blocks_in(self, block_hashes: Sequence[bytes], tier: str) -> int:
        return 0

    def close(self) -> None:
        return None
