"""A bounded soak on loopback: many concurrent streaming clients for a while against the
poisoned-model server (cpu and disk tiers with small budgets, a device pool small enough
to preempt). No error, every output equals the cold run's, no block held afterwards,
process memory stable, store budgets never exceeded.

CI size by default; KVTIER_SOAK_SECONDS and KVTIER_SOAK_CLIENTS make it longer or wider.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx
import pytest
from reliability_support import (
    ADMIN_TOKEN,
    ColdOracle,
    FaultServer,
    bytes_on_disk,
    random_prompts,
    rss_bytes,
)
from scorecard import Scorecard
from sse_client import kv_stats, server_held_blocks, stream, wait_idle

SOAK_SECONDS = float(os.environ.get("KVTIER_SOAK_SECONDS", "20"))
SOAK_CLIENTS = int(os.environ.get("KVTIER_SOAK_CLIENTS", "64"))
MAX_TOKENS = 8
WARMUP_FRACTION = 0.25  # memory is compared with its level at the end of the warm-up
RSS_GROWTH_BOUND = 64 * 1024**2
SAMPLE_EVERY_S = 0.5

pytestmark = pytest.mark.timeout(SOAK_SECONDS + 240)


def prompt_pool() -> list[list[int]]:
    """Eight shared 96-token prefixes (documents, system prompts), four 32-token
    questions each: more distinct tokens than the device pool holds, so the cpu and disk
    tiers serve what it evicted."""
    prefixes = random_prompts(8, 96, seed=61)
    suffixes = random_prompts(32, 32, seed=62)
    return [prefix + suffixes[4 * i + j] for i, prefix in enumerate(prefixes) for j in range(4)]


@dataclass
class Tally:
    served: int = 0
    errors: int = 0
    wrong: int = 0
    first_token_s: list[float] = field(default_factory=list)
    rss: list[tuple[float, int]] = field(default_factory=list)
    over_budget: int = 0
    peak_disk_bytes: int = 0
    tier_peaks: dict[str, int] = field(default_factory=dict)


async def client(http: httpx.AsyncClient, pool: list[list[int]], want: list[str], seed: int,
                 deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        index = rng.randrange(len(pool))
        answer = await stream(http, pool[index], MAX_TOKENS)
        tally.served += 1
        if answer.status != 200 or answer.error is not None or not answer.done:
            tally.errors += 1
        elif answer.text != want[index]:
            tally.wrong += 1
        if answer.first_token_s is not None:
            tally.first_token_s.append(answer.first_token_s)


async def sampler(server: FaultServer, deadline: float, tally: Tally) -> None:
    started = time.monotonic()
    while time.monotonic() < deadline:
        tally.rss.append((time.monotonic() - started, rss_bytes(server.pid)))
        tally.peak_disk_bytes = max(tally.peak_disk_bytes, bytes_on_disk(server.disk_path))
        tiers = (await asyncio.to_thread(kv_stats, server.url, ADMIN_TOKEN))["tiers"]
        for name, stats in tiers.items():
            tally.over_budget += stats["usage_bytes"] > stats["capacity_bytes"]
            tally.tier_peaks[name] = max(tally.tier_peaks.get(name, 0), stats["usage_bytes"])
        await asyncio.sleep(SAMPLE_EVERY_S)


async def soak(server: FaultServer, pool: list[list[int]], want: list[str]) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + SOAK_SECONDS
    limits = httpx.Limits(max_connections=SOAK_CLIENTS + 4)
    async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=limits) as http:
        await asyncio.gather(sampler(server, deadline, tally), *(
            client(http, pool, want, seed, deadline, tally) for seed in range(SOAK_CLIENTS)
        ))
    return tally


def memory_growth(rss: list[tuple[float, int]]) -> tuple[int, int]:
    """(RSS at the end of the warm-up, growth of the peak after it)."""
    warm = [r for t, r in rss if t <= WARMUP_FRACTION * SOAK_SECONDS] or [rss[0][1]]
    baseline = warm[-1]
    return baseline, max(r for _, r in rss) - baseline


def store_hits(stats: dict) -> int:
    return sum(tier["hit_tokens"] for tier in stats["tiers"].values())


def test_soak_streaming_clients(fault_server: FaultServer, model_path: str, cold: ColdOracle,
                                scorecard: Scorecard):
    pool = prompt_pool()
    want = cold.texts(model_path, pool, MAX_TOKENS)
    before = kv_stats(fault_server.url, ADMIN_TOKEN)
    started = time.monotonic()
    tally = asyncio.run(soak(fault_server, pool, want))
    elapsed = time.monotonic() - started
    drain_s = wait_idle(fault_server.url, ADMIN_TOKEN)
    after = kv_stats(fault_server.url, ADMIN_TOKEN)
    baseline, growth = memory_growth(tally.rss)
    ttft = sorted(tally.first_token_s)
    scorecard.add(
        "load", f"soak: {SOAK_CLIENTS} streaming clients, {SOAK_SECONDS:g} s", requests=tally.served,
        wrong_outputs=tally.wrong, leaked_blocks=server_held_blocks(after), recovery_s=drain_s, errors=tally.errors,
        requests_per_s=tally.served / elapsed, ttft_p50_s=statistics.median(ttft),
        ttft_p99_s=ttft[int(0.99 * (len(ttft) - 1))], rss_after_warmup_mib=baseline / 2**20,
        rss_growth_mib=growth / 2**20, rss_growth_bound_mib=RSS_GROWTH_BOUND / 2**20,
        budget_samples_over=tally.over_budget, peak_bytes_on_disk=tally.peak_disk_bytes,
        store_hit_tokens=store_hits(after) - store_hits(before), preemptions=after["device"]["num_preemptions_total"],
        **{f"peak_{t}_usage_of_budget": tally.tier_peaks[t] / after["tiers"][t]["capacity_bytes"]
           for t in tally.tier_peaks},
    )
    assert tally.served > SOAK_CLIENTS and tally.errors == 0 and tally.wrong == 0
    assert after["device"]["kv_cache_usage_perc"] == 0
    assert tally.over_budget == 0
    assert tally.peak_disk_bytes <= after["tiers"]["disk"]["capacity_bytes"]
    assert growth <= RSS_GROWTH_BOUND
