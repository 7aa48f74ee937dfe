"""A server faults in its cpu tier's memory at start, before it takes traffic.

Robust to a busy host, still able to fail: a page the kernel swapped out under memory
pressure since start was faulted in all the same (a never-touched page is neither
resident nor swapped), so resident + swapped must cover the slab; and a host with less
memory available at start than the slab is one where the server rightly declines (it
says so), which skips rather than fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.server.server_helpers import ServerProcess, server_flags

# Past the 512 MiB the store's populator keeps faulted in ahead of use, so that only a
# whole-slab populate at start makes all of it resident.
CPU_TIER_MIB = 600


def mappings(pid: int) -> list[tuple[int, int]]:
    """(size KiB, faulted-in KiB: resident or swapped out) of each mapping of the process."""
    found, size, rss = [], 0, 0
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name == "Size":
            size = int(rest.split()[0])
        elif name == "Rss":
            rss = int(rest.split()[0])
        elif name == "Swap":  # after Rss in every mapping's block
            found.append((size, rss + int(rest.split()[0])))
    return found


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/PID/smaps")
def test_a_server_starts_with_its_cpu_tier_resident(model_path):
    server = ServerProcess(*server_flags(
        model_path, "--kv-offload", "cpu", "--kv-offload-cpu-size", f"{CPU_TIER_MIB}MiB", "--kv-chunk-tokens", "32"))
    try:
        found = mappings(server.pid)
    finally:
        server.stop()
    if "of memory available now; its pages are faulted in as it fills" in server.output:
        pytest.skip(f"the host had less than {CPU_TIER_MIB} MiB of memory available when the server started")
    # The slab is one allocation, but the kernel may merge its mapping with an adjacent
    # anonymous one of the same flags: look for a mapping holding it, faulted in whole.
    slab_kib = (CPU_TIER_MIB - 1) * 1024  # whole slots: the slab may be a little under the size asked
    holding = [(size, touched) for size, touched in found if size >= slab_kib]
    assert holding, f"no mapping of {slab_kib} KiB or more: {sorted(found)[-3:]}"
    assert max(touched for _, touched in holding) >= slab_kib, \
        f"the cpu tier is not resident: {holding} (size KiB, resident or swapped out KiB)"
