"""How the router ranks the instances for a request (`--policy`). Each policy returns
the healthy instances best first; the router sends to the first and retries a request
that fails before its first byte on the second.

kv: the lowest expected cost, in tokens of prefill: the prompt's tokens, less those in
the instance's device cache (free), less those it can load, each at a share of a computed
token's cost by tier (TIER_COST), plus LOAD_TOKENS per request on the instance (`load`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from itertools import count

from engine.router.fleet_index import FleetIndex
from engine.router.naming import PromptBlocks
from engine.router.workers import Worker

# A loaded token's cost as a share of a computed one's. Measured on this project's 2-core
# CPU hosts with the built-in model: a 3,500-token document loaded from a shared Redis in
# 4.1 s against 43 s computed (about 0.1), a cpu tier hit several times faster than that.
TIER_COST = {"cpu": 0.02, "disk": 0.05, "shared": 0.1}
# A request on an instance, in tokens of prefill it delays a new one by.
LOAD_TOKENS = 256


def load(worker: Worker) -> float:
    """Requests on an instance: those the router has in flight there, plus those its
    /metrics last reported waiting that the router did not send (clients that bypass the
    router queue there too). Not
    its reported running count: that is up to --health-check-interval old, and a request
    that has just finished would keep counting against the instance that holds its KV."""
    return worker.in_flight + worker.waiting


class Policies:
    def __init__(self, index: FleetIndex) -> None:
        self._index = index
        self._turn = count()

    def round_robin(self, workers: Sequence[Worker]) -> list[Worker]:
        start = next(self._turn) % len(workers)
        return [*workers[start:], *workers[:start]]

    def least_load(self, workers: Sequence[Worker]) -> list[Worker]:
        rotated = self.round_robin(workers)  # equal loads take turns
        return sorted(rotated, key=load)

    def session(self, workers: Sequence[Worker], key: str | None) -> list[Worker]:
        """Rendezvous hashing: a key keeps its instance while that one is in the pool,
        and only the keys of an instance that leaves move."""
        if key is None:
            return self.least_load(workers)
        return sorted(workers, key=lambda w: hashlib.sha256(f"{key}\0{w.url}".encode()).digest(), reverse=True)

    def kv(self, workers: Sequence[Worker], prompt: PromptBlocks | None, block_size: int) -> list[Worker]:
        if prompt is None:
            return self.least_load(workers)
        holdings = self._index.holdings([w.url for w in workers], prompt.blocks)

        def cost(worker: Worker) -> float:
            held = holdings[worker.url]
            to_compute = prompt.tokens - held.blocks * block_size
            loading = sum(n * block_size * TIER_COST[tier] for tier, n in held.loadable.items())
            return to_compute + loading + LOAD_TOKENS * load(worker)

        return sorted(self.round_robin(workers), key=cost)
