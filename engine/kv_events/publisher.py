"""The ZMQ publisher of KV event batches: vLLM's PUB socket and replay ROUTER protocol,
on a thread of its own, so that encoding and sending never run on the engine thread.

The engine thread only appends events to a queue (`put`). The publisher thread takes
whatever has queued up as one batch, encodes it (schema.py), sends it as [topic,
sequence number (8 bytes big-endian), payload] and keeps the last `buffer_steps` batches.
A subscriber that sees a gap in the sequence numbers sends the first number it missed
(8 bytes big-endian, after an empty delimiter frame, as a DEALER or REQ does) to the
replay endpoint and gets every buffered batch from there as [seq, payload] messages,
then [-1 as 8 bytes, b""].
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from engine.kv_events.config import KVEventsConfig
from engine.kv_events.schema import KVCacheEvent, KVEventBatch, encoder

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
MAX_EVENTS_PER_BATCH = 4096
POLL_S = 0.05


class KVEventsEndpointError(ValueError):
    """The PUB or replay endpoint cannot be bound or connected."""


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self._topic = config.topic.encode()
        self._rank = data_parallel_rank
        self._events: queue.Queue[KVCacheEvent | threading.Event] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            _open(self._pub, config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._context.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise KVEventsEndpointError(f"cannot open the KV events endpoint: {exc}") from None
        self.endpoint = _last_endpoint(self._pub) or config.endpoint
        self.replay_endpoint = _last_endpoint(self._replay) if self._replay is not None else None
        self.dropped_events = 0
        self._next_seq = 0
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def put(self, event: KVCacheEvent) -> None:
        """Queue one event (any thread). A full queue drops it, counted and logged: the
        engine thread never waits for subscribers."""
        try:
            self._events.put_nowait(event)
        except queue.Full:
            if not self.dropped_events:
                log.warning("kv events: the queue is full (max_queue_size); events are being dropped")
            self.dropped_events += 1

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every event queued before this call has been sent; False on timeout."""
        sent = threading.Event()
        self._events.put(sent, timeout=timeout_s)
        return sent.wait(timeout_s)

    @property
    def last_seq(self) -> int:
        """The sequence number of the last batch sent (-1 before the first)."""
        return self._next_seq - 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Send what is queued, then close the sockets."""
        if self._stopping:
            return
        self.flush(timeout_s)
        self._stopping = True
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    def _run(self) -> None:
        pack = encoder()
        while not self._stopping:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._events.get(timeout=POLL_S)
            except queue.Empty:
                continue
            events: list[KVCacheEvent] = []
            markers: list[threading.Event] = []
            while True:
                (markers if isinstance(item, threading.Event) else events).append(item)
                if len(events) >= MAX_EVENTS_PER_BATCH:
                    break
                try:
                    item = self._events.get_nowait()
                except queue.Empty:
                    break
            if events:
                self._send(pack.encode(KVEventBatch(time.time(), events, self._rank)))
            for marker in markers:
                marker.set()

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        except zmq.ZMQError as exc:
            log.warning("kv events: batch %d not sent (%s); subscribers can replay it", seq, exc)
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames was ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)


def _open(sock: zmq.Socket, endpoint: str) -> None:
    """vLLM's rule: a wildcard, ipc:// or inproc:// endpoint is bound, another connected."""
    if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)


def _last_endpoint(sock: zmq.Socket) -> str | None:
    value = sock.getsockopt(zmq.LAST_ENDPOINT)
    return value.decode() if value else None
