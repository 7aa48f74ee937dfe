"""Chunk geometry and load-job arithmetic: which tokens arrived, which blocks to write."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from connectors.chunks import ChunkGeometry, LoadJob
from kvstore import LoadResult

GEOMETRY = ChunkGeometry(block_size=4, chunk_tokens=16)  # 4 blocks per chunk


def job(first_chunk: int, start: int, end: int, num_chunks: int) -> LoadJob:
    table = list(range(100, 100 + (end - start) // 4))
    return LoadJob("r", first_chunk, start, end, [object()] * num_chunks, Future(), False, table)


@pytest.mark.parametrize(
    ("num_tokens", "end"),
    [(1, 0), (4, 0), (5, 4), (16, 12), (17, 16), (33, 32)],
)
def test_loadable_end_leaves_the_last_token_in_whole_blocks(num_tokens, end):
    assert GEOMETRY.loadable_end(num_tokens) == end


def test_scatter_plan_skips_the_blocks_of_the_device_hit():
    # The device hit ends inside chunk 1 (token 24 = block 6); chunks 1 and 2 are loaded.
    load = job(first_chunk=1, start=24, end=48, num_chunks=2)
    plan = load.scatter_plan(48, GEOMETRY)
    assert plan == [(0, slice(2, 4), [100, 101]), (1, slice(0, 4), [102, 103, 104, 105])]


def test_scatter_plan_stops_at_what_arrived():
    load = job(first_chunk=0, start=0, end=44, num_chunks=3)
    assert load.scatter_plan(16, GEOMETRY) == [(0, slice(0, 4), [100, 101, 102, 103])]
    assert load.scatter_plan(0, GEOMETRY) == []


@pytest.mark.parametrize(
    ("tiers", "loaded_end"),
    [
        (("cpu", "disk", "redis"), 44),  # the job ends inside its last chunk
        (("cpu", None, "redis"), 32),  # a gap: only the leading run counts
        ((None, "cpu", "cpu"), 24),  # the first chunk failed: nothing past the hit
    ],
)
def test_loaded_end_counts_only_the_leading_run(tiers, loaded_end):
    load = job(first_chunk=1, start=24, end=44, num_chunks=3)
    assert load.loaded_end(LoadResult(tiers), GEOMETRY) == loaded_end


def test_tokens_by_tier_counts_only_tokens_past_the_hit():
    load = job(first_chunk=1, start=24, end=44, num_chunks=3)
    result = LoadResult(("cpu", "disk", "disk"))
    assert load.tokens_by_tier(result, 44, GEOMETRY) == {"cpu": 8, "disk": 12}
    assert load.tokens_by_tier(result, 32, GEOMETRY) == {"cpu": 8}


def test_tier_runs_keep_token_order_and_merge_neighbours():
    load = job(first_chunk=1, start=24, end=56, num_chunks=3)
    assert load.tier_runs(LoadResult(("disk", "disk", "cpu")), 56, GEOMETRY) == [("disk", 24), ("cpu", 8)]
    assert load.tier_runs(LoadResult(("cpu", "disk", "cpu")), 56, GEOMETRY) == [("cpu", 8), ("disk", 16), ("cpu", 8)]
