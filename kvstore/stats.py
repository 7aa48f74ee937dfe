"""Store-wide counters and the snapshot the server turns into `kvtier:` metrics."""

from __future__ import annotations

from dataclasses import dataclass

from tiers.stats import CounterSet, TierSnapshot

STORE_COUNTER_FIELDS: tuple[str, ...] = (
    "lookups",
    "lookup_chunks",  # chunks asked about
    "lookup_hit_chunks",  # chunks in the returned prefix runs
    "loads",
    "load_chunks",
    "load_hit_chunks",
    "saves",
    "save_chunks",
    "save_dropped_chunks",  # lower-tier writes skipped: too many bytes already pending
    "save_failed_chunks",  # a configured tier could not store the chunk
    "promotions",  # lower-tier hits copied into the cpu tier
    "prefetch_chunks",  # chunks prefetched into the cpu tier
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
