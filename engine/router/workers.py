"""The instances behind the router: their health, load and facts (/instance), each
with its KV event stream feeding the FleetIndex.

Every `--health-check-interval` each instance's /load is read (its load, and its
`instance_id`), and its /instance when that is new. One that fails (or fails a request
before its first byte) leaves the pool, and the index forgets it; one that answers again,
comes back as a new process (a new `instance_id`) or whose event stream failed, joins again
with a fresh event stream, which first replays what the instance still buffers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError

from engine.router.event_stream import EventStream
from engine.router.fleet_index import FleetIndex
from engine.router.upstream import Upstream, UpstreamError
from engine.server.instance_info import InstanceInfo, InstanceLoad

log = logging.getLogger(__name__)

CHECK_TIMEOUT_S = 5.0


@dataclass(eq=False)
class Worker:
    url: str
    info: InstanceInfo | None = None
    healthy: bool = False
    in_flight: int = 0  # requests the router has sent there and not finished
    waiting: float = 0.0  # waiting there and not sent by the router (see _read_load)
    kv_usage: float = 0.0
    refused: str | None = None  # why it answers but stays out of the pool (logged once)
    stream: EventStream | None = field(default=None, repr=False)
    upstream: Upstream = field(init=False, repr=False)  # the connections to it

    def __post_init__(self) -> None:
        self.upstream = Upstream(self.url)


class WorkerPool:
    def __init__(
        self, urls: Sequence[str], index: FleetIndex,
        on_join: Callable[[InstanceInfo], object] = lambda info: None,
        refuse: Callable[[str, InstanceInfo], Exception | None] = lambda url, info: None,
    ) -> None:
        """`refuse(url, info)`: why an answering instance must stay out of the pool, or None."""
        self.workers = [Worker(url) for url in urls]
        self._index = index
        self._on_join = on_join
        self._refuse = refuse

    def healthy(self) -> list[Worker]:
        return [w for w in self.workers if w.healthy]

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(w) for w in self.workers))

    async def run(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            await self.check_all()

    async def check(self, worker: Worker) -> None:
        try:
            async with asyncio.timeout(CHECK_TIMEOUT_S):
                status, body = await worker.upstream.get("/load")
                if status >= 400:
                    raise UpstreamError(f"/load answered {status}")
                load = InstanceLoad.model_validate_json(body)
                stream_failed = worker.stream is not None and not worker.stream.alive
                known = worker.info is not None and worker.info.instance_id == load.instance_id
                info = None if known and not stream_failed else InstanceInfo.model_validate_json(
                    (await worker.upstream.get("/instance"))[1])
        except (UpstreamError, TimeoutError, ValidationError) as exc:
            if worker.healthy:
                log.warning("router: %s leaves the pool (%s)", worker.url, exc)
            self.leave(worker)
            return
        if info is not None:
            refused = self._refuse(worker.url, info)
            if refused is not None:
                if worker.refused != str(refused):
                    log.error("router: %s stays out of the pool (%s)", worker.url, refused)
                worker.refused = str(refused)
                self.leave(worker)
                return
            worker.refused = None
            await self._join(worker, info)
        self._read_load(worker, load)
        worker.healthy = True

    def leave(self, worker: Worker) -> None:
        """Out of the pool until a check finds it answering again."""
        self._forget(worker)
        worker.upstream.close()

    def close(self) -> None:
        for worker in self.workers:
            self.leave(worker)

    def _forget(self, worker: Worker) -> None:
        """Nothing known of the instance (its connections stay open)."""
        worker.healthy = False
        worker.info = None
        if worker.stream is not None:
            worker.stream.stop()
            worker.stream = None
        self._index.leave(worker.url)

    async def _join(self, worker: Worker, info: InstanceInfo) -> None:
        self._forget(worker)
        await asyncio.to_thread(self._on_join, info)  # builds the fingerprint's namer once
        self._index.join(worker.url, info.shared_store)
        if info.kv_events is not None:
            url = worker.url
            worker.stream = EventStream(url, info.kv_events, lambda batch: self._index.apply(url, batch.events))
        worker.info = info
        log.info("router: %s joins the pool (%s)", worker.url, info.model)

    @staticmethod
    def _read_load(worker: Worker, load: InstanceLoad) -> None:
        """The instance's load. Its waiting count less the router's requests in flight
        there: those count already, and without the subtraction a request that was
        waiting (for a Redis lookup, say) when the load was read would count against the
        instance until the next check, long after it finished there, steering the kv
        policy away from the instance that holds its KV."""
        worker.kv_usage = load.kv_cache_usage_perc
        worker.waiting = max(0.0, load.num_requests_waiting - worker.in_flight)
