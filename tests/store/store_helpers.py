"""Helpers of the store tests and of their subprocess workers: a Redis Cluster of real
redis-server processes (bench.redis_server), a tiny ChunkSpec, deterministic chunk
payloads, how much of a memory range is resident."""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import time

import torch

from bench.redis_server import RedisServer
from kvstore import ChunkSpec

CLUSTER_SLOTS = 16384


def build_cluster(nodes: list[RedisServer]) -> None:
    """Make the running nodes one cluster of masters with the slots split evenly."""
    share = CLUSTER_SLOTS // len(nodes)
    for index, node in enumerate(nodes):
        last = CLUSTER_SLOTS if index == len(nodes) - 1 else (index + 1) * share
        node.client().execute_command("CLUSTER", "ADDSLOTS", *range(index * share, last))
    for node in nodes[1:]:
        nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        states = [n.client().execute_command("CLUSTER", "INFO").decode() for n in nodes]
        if all(
            "cluster_state:ok" in s and f"cluster_known_nodes:{len(nodes)}" in s for s in states
        ):
            return
        time.sleep(0.1)
    raise RuntimeError("redis cluster did not converge")


def chunk_payload(spec: ChunkSpec, seed: int | bytes) -> torch.Tensor:
    """A deterministic chunk for `seed`, so any process can check what it reads."""
    digest = hashlib.sha256(seed if isinstance(seed, bytes) else str(seed).encode()).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))
    return torch.randn(spec.shape, generator=generator).to(spec.dtype)


def make_spec(
    dtype: torch.dtype | str = torch.float32,
    fingerprint: bytes | None = None,
    chunk_tokens: int = 16,
) -> ChunkSpec:
    """A tiny KV layout: 2 layers, 2 KV heads, head_dim 8, block size 4."""
    return ChunkSpec.for_kv_layout(
        fingerprint or hashlib.sha256(b"test-model").digest(),
        num_layers=2,
        block_size=4,
        num_kv_heads=2,
        head_dim=8,
        dtype=dtype,
        chunk_tokens=chunk_tokens,
    )


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (NaN-safe, dtype-agnostic)."""
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def resident_fraction(address: int, nbytes: int) -> float:
    """Of the whole pages inside [address, address + nbytes), the fraction in memory
    (mincore; for a file mapping, in the page cache)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    first = -(-address // mmap.PAGESIZE) * mmap.PAGESIZE
    pages = ((address + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE - first) // mmap.PAGESIZE
    flags = ctypes.create_string_buffer(pages)
    assert libc.mincore(first, pages * mmap.PAGESIZE, flags) == 0, ctypes.get_errno()
    return sum(b & 1 for b in flags.raw) / pages
