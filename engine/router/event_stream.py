"""One instance's KV event stream, followed on a thread: ZMQ SUB for the live batches and
the replay endpoint for what the SUB socket missed (vLLM's protocol, engine/kv_events).

It first asks the replay endpoint for everything buffered (the instance may have run for
a while), then applies live batches in sequence order; a gap is filled by a replay
before the next batch is applied (an earlier one is a duplicate, already replayed).
Batches go to the FleetIndex. A restarted instance gets a new stream (workers.py sees
its new `instance_id`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

import zmq

from engine.kv_events.schema import KVEventBatch, decoder
from engine.server.instance_info import EventEndpoints

log = logging.getLogger(__name__)

POLL_MS = 200
REPLAY_TIMEOUT_MS = 5000
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def reachable(endpoint: str, instance_url: str) -> str:
    """`endpoint` as bound by the instance (tcp://*:5557, tcp://0.0.0.0:5557) with the
    wildcard host replaced by the host of the instance's URL."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if scheme != "tcp" or not colon or host not in WILDCARD_HOSTS:
        return endpoint
    return f"{scheme}{sep}{urlsplit(instance_url).hostname}:{port}"


class EventStream:
    def __init__(
        self, instance_url: str, endpoints: EventEndpoints, apply: Callable[[KVEventBatch], None]
    ) -> None:
        self.endpoint = reachable(endpoints.endpoint, instance_url)
        self.replay_endpoint = (
            None if endpoints.replay_endpoint is None else reachable(endpoints.replay_endpoint, instance_url)
        )
        self._topic = endpoints.topic.encode()
        self._apply = apply
        self._decode = decoder()
        self._context = zmq.Context.instance()
        self._stop = threading.Event()
        self.next_seq = 0
        self.batches = 0
        self.replays = 0
        self._thread = threading.Thread(target=self._run, name=f"kv-events {instance_url}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        """False once the stream failed (its thread ended without being stopped)."""
        return self._thread.is_alive() or self._stop.is_set()

    def stop(self) -> None:
        """Stop applying batches now; the thread closes its sockets within POLL_MS."""
        self._stop.set()

    def _run(self) -> None:
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        sub.connect(self.endpoint)
        try:
            self._replay(0)
            while not self._stop.is_set():
                if not sub.poll(POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if seq > self.next_seq:
                    self._replay(self.next_seq)
                if seq == self.next_seq:
                    self._take(frames[2])
        except Exception:  # a thread that dies silently would leave the index stale
            log.exception("router: the event stream of %s failed", self.endpoint)
        finally:
            sub.close(linger=0)

    def _replay(self, first: int) -> None:
        """Apply the buffered batches from `first` on; without a replay endpoint the
        stream continues from the next live batch."""
        if self.replay_endpoint is None:
            return
        dealer = self._context.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", first.to_bytes(8, "big")))
            while not self._stop.is_set():
                if not dealer.poll(REPLAY_TIMEOUT_MS):
                    log.warning("router: no replay from %s", self.replay_endpoint)
                    return
                frames = dealer.recv_multipart()
                seq = int.from_bytes(frames[-2], "big", signed=True)
                if seq < 0:
                    self.replays += 1
                    return
                if seq >= self.next_seq:
                    self.next_seq = seq
                    self._take(frames[-1])
        finally:
            dealer.close(linger=0)

    def _take(self, payload: bytes) -> None:
        if self._stop.is_set():
            return
        self._apply(self._decode.decode(payload))
        self.batches += 1
        self.next_seq += 1
