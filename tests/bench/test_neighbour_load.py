"""The neighbours the bench starts beside a server are running while the block runs, and
gone when it ends, also when it ends by an exception; the scheduler's account of a
process tree's CPU time holds its children."""

from __future__ import annotations

import os

import pytest

from bench.neighbour_load import NEIGHBOURS, neighbours
from bench.schedstat import tree_cpu_seconds


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_crowd_runs_three_processes_and_stops_them():
    with neighbours("crowd") as pids:
        assert len(pids) == len(NEIGHBOURS["crowd"]) == 3
        assert all(_alive(pid) for pid in pids)
        assert os.getpid() not in pids
    assert not any(_alive(pid) for pid in pids)


def test_neighbours_stop_when_the_block_raises():
    seen: list[int] = []
    with pytest.raises(KeyError), neighbours("busy loop") as pids:
        seen += pids
        raise KeyError("the measurement failed")
    assert seen and not any(_alive(pid) for pid in seen)


def test_quiet_starts_nothing():
    with neighbours("quiet") as pids:
        assert pids == []


def test_schedstat_counts_the_threads_of_child_processes():
    with neighbours("busy loop") as pids:
        child_ran, _ = tree_cpu_seconds(pids[0])
        assert child_ran > 0  # it ran through its settling time
        tree_ran, _ = tree_cpu_seconds(os.getpid())
        assert tree_ran >= child_ran  # this process's tree holds the busy loop
