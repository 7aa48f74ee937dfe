"""Records in and out of a TieredStore as caller tensors, over the engine's own path (for
tests and the store benchmark; the product moves blocks only through the connector's
worker).

`save_tensors` does what the worker does for a save: reserve a host slot, copy the
blocks into its payload, commit it (write-behind to the record tiers). `load_tensors`
does what the planner and the worker do for a load, one record at a time: locate it,
open a load of its blocks (reads into host slots on the read pool), view and copy what
arrived, close the load (promotion, slots released). A key the index does not know is
asked of every record tier by name, as another process may have written it there.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import torch

from kvstore import ChunkKey, TieredStore, host_copy
from kvstore.index import BlockLocation, StoredRecord
from kvstore.saving import SaveResult

T = TypeVar("T")


@dataclass(frozen=True)
class LoadResult:
    """Per key, the tier that delivered the record, or None for a miss."""

    tiers: tuple[str | None, ...]

    @property
    def ok(self) -> tuple[bool, ...]:
        return tuple(t is not None for t in self.tiers)

    @property
    def num_leading_ok(self) -> int:
        for index, tier in enumerate(self.tiers):
            if tier is None:
                return index
        return len(self.tiers)


def save_tensors(store: TieredStore, keys: Sequence[ChunkKey], tensors: Sequence[torch.Tensor]) -> Future[SaveResult]:
    """Store records copied from `tensors` (`[n, *block shape]`, n the key's blocks).
    The tensors are copied before this returns; the future completes when the record
    tiers are written. A record the store holds already, or for which no slot is free,
    is not saved (the future names the tiers holding it)."""
    manager, transfers = store.manager, store.transfers
    manager.check_open()
    if len(keys) != len(tensors):
        raise ValueError(f"{len(keys)} keys but {len(tensors)} tensors")
    for key, tensor in zip(keys, tensors, strict=True):
        if store.spec.check_tensor(tensor) != key.num_blocks:
            raise ValueError(f"key {key.name} has {key.num_blocks} blocks, its tensor {tensor.shape[0]}")
    manager.poll()
    futures: list[Future[frozenset[str]]] = []
    for key, tensor in zip(keys, tensors, strict=True):
        slot = transfers.reserve(key)
        if slot is None:
            record = manager.index.get(key.name)
            futures.append(_done(frozenset(record.tiers) if record is not None else frozenset()))
            continue
        started = time.perf_counter()
        host_copy(transfers.payload(slot, key.num_blocks), tensor)
        futures.append(transfers.commit(slot, key, time.perf_counter() - started))
    return _gather(futures, transfers.all_tiers)


def load_tensors(
    store: TieredStore, keys: Sequence[ChunkKey], outs: Sequence[torch.Tensor], timeout_s: float | None = None
) -> Future[LoadResult]:
    """Copy the records of `keys` into `outs` (`[n, *block shape]` or larger). Returns
    once they are copied, within `timeout_s` (default: the load timeout), with a future
    that is done; a record counts as loaded only when all its blocks arrived."""
    manager, transfers = store.manager, store.transfers
    manager.check_open()
    if len(keys) != len(outs):
        raise ValueError(f"{len(keys)} keys but {len(outs)} output tensors")
    for key, out in zip(keys, outs, strict=True):
        if store.spec.check_tensor(out) < key.num_blocks:
            raise ValueError(f"the output for {key.name} holds fewer than its {key.num_blocks} blocks")
    manager.poll()
    loads = [transfers.open_load(_run(store, key), timeout_s) for key in keys]
    tiers: list[str | None] = []
    for key, out, load in zip(keys, outs, loads, strict=True):
        load.wait()
        arrived = bool(load.parts) and load.arrived_blocks() == key.num_blocks
        if arrived:
            offset = 0
            for part in load.parts:
                host_copy(out[offset : offset + part.count], transfers.view(part))
                offset += part.count
        tiers.append(load.parts[0].tier if arrived else None)
        transfers.close_load(load)
    return _done(LoadResult(tuple(tiers)))


def _run(store: TieredStore, key: ChunkKey) -> list[BlockLocation]:
    """The blocks of `key`'s record as a located run: the index's record, or one to read
    by name from every record tier when the index does not know it."""
    record = store.manager.index.get(key.name)
    if record is None:
        record = StoredRecord(key.name, key.first_block, list(key.block_hashes), {t.name for t in store.lower})
    return [BlockLocation(record, position) for position in range(key.num_blocks)]


def _done(value: T) -> Future[T]:
    future: Future[T] = Future()
    future.set_result(value)
    return future


def _gather(futures: list[Future[frozenset[str]]], all_tiers: frozenset[str]) -> Future[SaveResult]:
    result: Future[SaveResult] = Future()
    remaining = [len(futures)]

    def one_done(_: Future[frozenset[str]]) -> None:
        remaining[0] -= 1
        if remaining[0] == 0:
            stored = tuple(f.result() for f in futures)
            result.set_result(SaveResult(stored, all(all_tiers <= s for s in stored)))

    if not futures:
        result.set_result(SaveResult((), True))
    for future in futures:
        future.add_done_callback(one_done)
    return result
