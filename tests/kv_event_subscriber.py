"""A KV event subscriber written against vLLM's schema, not kvtier's: the structs below
mirror vllm/distributed/kv_events.py (events as tagged maps in an array batch), so the
tests that use it check the wire format a vLLM consumer decodes. SUB for the stream,
DEALER for vLLM's replay protocol."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import zmq


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int | bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Subscriber:
    """A vLLM-style subscriber: SUB for the stream, DEALER for replays; `drop` names
    sequence numbers to ignore when they first arrive (as if lost)."""

    def __init__(self, endpoint: str, replay: str | None, drop: set[int] = frozenset()) -> None:
        self.context = zmq.Context.instance()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.replay_endpoint = replay
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.held: dict[str, set[int]] = {}
        self.next_seq = 0
        self.drop = set(drop)
        self.replayed = 0

    def catch_up(self, last_seq: int) -> None:
        """Apply batches up to `last_seq`; what does not come (sent before the SUB socket
        joined, or lost) is asked of the replay endpoint."""
        while self.next_seq <= last_seq:
            if not self.sub.poll(1000):
                self._replay(self.next_seq)
                continue
            _topic, seq_bytes, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq in self.drop:
                self.drop.discard(seq)
                continue
            if seq > self.next_seq:
                self._replay(self.next_seq)
            if seq == self.next_seq:
                self._apply(payload)

    def _replay(self, first: int) -> None:
        dealer = self.context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart((b"", first.to_bytes(8, "big")))
        while True:
            assert dealer.poll(20_000), "the replay endpoint did not answer"
            _, seq_bytes, payload = dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                break
            if seq == self.next_seq:
                self.replayed += 1
                self._apply(payload)
        dealer.close(linger=0)

    def _apply(self, payload: bytes) -> None:
        batch = self.decoder.decode(payload)
        assert batch.data_parallel_rank == 0
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.held.clear()
            elif isinstance(event, BlockStored):
                assert event.block_size == 16
                self.held.setdefault(event.medium, set()).update(event.block_hashes)
            else:
                self.held.get(event.medium, set()).difference_update(event.block_hashes)
        self.next_seq += 1

    def wait_for(self, medium: str, blocks: int, timeout_s: float) -> set[int]:
        """Apply live batches until `medium` holds `blocks` blocks: a store finishes its
        writes chunk by chunk, in as many batches (a deadline, not a measured time)."""
        deadline = time.monotonic() + timeout_s
        while len(self.held.get(medium, ())) < blocks:
            held = len(self.held.get(medium, ()))
            assert time.monotonic() < deadline, f"{held} of {blocks} {medium} blocks after {timeout_s:.0f} s"
            if self.sub.poll(100):
                _topic, seq_bytes, payload = self.sub.recv_multipart()
                if int.from_bytes(seq_bytes, "big") > self.next_seq:
                    self._replay(self.next_seq)
                elif int.from_bytes(seq_bytes, "big") == self.next_seq:
                    self._apply(payload)
        return self.held[medium]

    def state(self) -> dict[str, set[int]]:
        return {medium: hashes for medium, hashes in self.held.items() if hashes}

    def close(self) -> None:
        self.sub.close(linger=0)
