"""A server faults in its cpu tier's memory at start, before it takes traffic."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.server.server_helpers import ServerProcess, server_flags

# Past the 512 MiB the store's populator keeps faulted in ahead of use, so that only a
# whole-slab populate at start makes all of it resident.
CPU_TIER_MIB = 600


def mappings(pid: int) -> list[tuple[int, int]]:
    """(size KiB, resident KiB) of each mapping of the process."""
    found, size = [], 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == "Size":
            size = int(rest.split()[0])
        elif name == "Rss":
            found.append((size, int(rest.split()[0])))
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/PID/smaps")
def test_a_server_starts_with_its_cpu_tier_resident(model_path):
    server = ServerProcess(*server_flags(
        model_path, "--kv-offload", "cpu", "--kv-offload-cpu-size", f"{CPU_TIER_MIB}MiB", "--kv-chunk-tokens", "32"))
    try:
        slab = [(size, rss) for size, rss in mappings(server.pid)
                if (CPU_TIER_MIB - 1) * 1024 <= size <= CPU_TIER_MIB * 1024 + 64]
    finally:
        server.stop()
    assert len(slab) == 1, slab
    size, rss = slab[0]
    assert rss >= size - 8, f"{rss} of {size} KiB resident"
