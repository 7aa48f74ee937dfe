"""Store-wide counters and the snapshot the server turns into `kvtier:` metrics."""

from __future__ import annotations

from dataclasses import dataclass

from tiers.stats import CounterSet, TierSnapshot

STORE_COUNTER_FIELDS: tuple[str, ...] = (
    "lookups",
    "lookup_blocks",  # blocks asked about
    "lookup_hit_blocks",  # blocks in the returned runs
    "probes",  # asynchronous lookups of a remote tier's block index
    "probe_hit_blocks",  # blocks a probe found
    "loads",
    "load_records",  # records a load needed from a record tier
    "load_hit_records",  # of those, records that arrived
    "placed_records",  # of those, read straight into the blocks they were loaded for
    "saves",  # records committed to the host slots
    "save_skipped_records",  # no slot could be had (every one held)
    "save_dropped_records",  # lower-tier writes skipped: too much already pending
    "save_failed_records",  # a configured tier could not store the record
    "promotions",  # lower-tier hits kept in the cpu tier
    "prefetch_records",  # records prefetched into the cpu tier
    "internal_errors",  # unexpected exceptions caught at the store boundary
)


class StoreCounters(CounterSet):
    def __init__(self) -> None:
        super().__init__(STORE_COUNTER_FIELDS)


@dataclass(frozen=True)
class StoreSnapshot:
    chunk_tokens: int
    counters: dict[str, int]
    tiers: dict[str, TierSnapshot]
    pinned_chunks: int
    pending_write_bytes: int
    worker_restarts: dict[str, int]

    def as_dict(self) -> dict:
        return {
            "chunk_tokens": self.chunk_tokens,
            **self.counters,
            "pinned_chunks": self.pinned_chunks,
            "pending_write_bytes": self.pending_write_bytes,
            "worker_restarts": dict(self.worker_restarts),
            "tiers": {name: tier.as_dict() for name, tier in self.tiers.items()},
        }
