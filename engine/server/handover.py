"""Prefill/decode disaggregation, the prefill instance's side: a request that asks for it
(vLLM's `kv_transfer_params: {"do_remote_decode": true}`) is answered only once its
prompt's full blocks are in the instance's shared tier (Redis, else a disk directory that
instances share), so that the decode instance the router sends it to next loads them
instead of computing them.

The store writes records behind the engine (write-behind), so the answer waits on the
store's own account of what the shared tier holds, read on the engine thread between
steps, up to HANDOVER_TIMEOUT_S: past it (a write dropped under pressure, a Redis down)
the answer goes out anyway and the decode instance computes what it misses.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from engine.server.errors import APIError
from engine.server.protocol import ChatCompletionRequest, CompletionRequest
from engine.server.state import ServerState
from engine.server.streams import EngineJob

log = logging.getLogger(__name__)

HANDOVER_TIMEOUT_S = 30.0
CHECK_INTERVAL_S = 0.01
SHARED_TIERS = ("redis", "disk")  # in order of preference


def handover_tier(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The tier a request's KV is handed over through; None when it asks for no handover.
    A 400 when it asks and this instance cannot."""
    if not body.hands_over_kv:
        return None
    if body.stream:
        raise APIError(400, "do_remote_decode is served for non-streamed requests only",
                       param="kv_transfer_params", code="invalid_value")
    tier = next((t for t in SHARED_TIERS if t in state.kv_offload), None)
    if tier is None:
        raise APIError(400, "do_remote_decode needs a tier other instances load from (--kv-offload redis or "
                       "disk)", param="kv_transfer_params", code="invalid_value")
    return tier


async def wait_for_handover(state: ServerState, jobs: Sequence[EngineJob], tier: str, cache_salt: str | None) -> None:
    """Return once `tier` holds every full block of each job's prompt, or at the timeout."""
    deadline = time.monotonic() + HANDOVER_TIMEOUT_S
    for job in jobs:
        while True:
            stored, total = await state.engine.call(
                lambda engine, job=job: engine.kv_stored_in(job.token_ids, tier, cache_salt))
            if stored >= total:
                break
            if time.monotonic() > deadline:
                log.warning("handover: %s has %d of %d blocks of %s after %.0f s; answering anyway",
                            tier, stored, total, job.request_id, HANDOVER_TIMEOUT_S)
                return
            await asyncio.sleep(CHECK_INTERVAL_S)
