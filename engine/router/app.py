"""`kvtier router`: the OpenAI-compatible front (FastAPI + uvicorn, like `kvtier serve`)
that sends each request to one instance and passes its answer through as it arrives.

A request's body is forwarded unchanged; the router reads it only to choose (its prompt's
blocks for --policy kv, its `user` for session). A request that fails before the
instance's first byte (no connection, or a 5xx answer) goes once to the next instance of
the ranking; an instance that cannot be reached leaves the pool at once. With
--prefill-urls and --decode-urls, each request is first prefilled on a prefill instance
(`_prefill`), then sent to a decode instance as it came.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import disable_created_metrics

from engine.config import RouterConfig
from engine.router.fleet_index import FleetIndex, Holding
from engine.router.metrics import CONTENT_TYPE, RouterMetrics
from engine.router.naming import PromptBlocks, RequestNamer
from engine.router.policies import Policies
from engine.router.roles import check_roles, role_conflict
from engine.router.workers import Worker, WorkerPool
from engine.server.api_server import bind_socket
from engine.server.errors import SERVER_ERROR, APIError, install_error_handlers
from engine.server.instance_info import InstanceInfo

log = logging.getLogger(__name__)

FORWARDED_REQUEST_HEADERS = ("authorization", "content-type", "x-request-id")
FORWARDED_RESPONSE_HEADERS = ("content-type", "retry-after", "cache-control", "x-request-id")
SESSION_HEADER = "x-session-id"
# fields of a request that its prefill-only copy leaves out (it is answered whole, one token)
PREFILL_DROPPED = ("stream", "stream_options", "max_completion_tokens", "logprobs", "top_logprobs")
ATTEMPTS = 2  # the first choice, then one other instance


class Router:
    """The pool, the index, the policies and the namers (one per model fingerprint)."""

    def __init__(self, config: RouterConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.client = client
        self.index = FleetIndex()
        self.namers: dict[str, RequestNamer] = {}
        self.pool = WorkerPool(config.all_urls, self.index, client, self._add_namer,
                               lambda url, info: role_conflict(config, url, info))
        self.policies = Policies(self.index)
        self.metrics = RouterMetrics(lambda: self.pool.workers, self.index)

    def _add_namer(self, info: InstanceInfo) -> None:
        if info.fingerprint not in self.namers:
            self.namers[info.fingerprint] = RequestNamer(info)

    async def rank(
        self, path: str, body: Any, headers: Any, urls: Collection[str]
    ) -> tuple[list[Worker], PromptBlocks | None]:
        """The instances of `urls` in the pool, best first for this request, and its
        prompt's blocks when known."""
        workers = [w for w in self.pool.healthy() if w.url in urls]
        model = body.get("model") if isinstance(body, dict) else None
        same_model = [w for w in workers if w.info is not None and w.info.model == model]
        workers = same_model or workers
        if not workers:
            return [], None
        fingerprints = {w.info.fingerprint for w in workers if w.info is not None}
        namer = self.namers.get(next(iter(fingerprints))) if len(fingerprints) == 1 else None
        prompt = await namer.name(path, body) if namer is not None else None
        policy = self.config.policy
        if policy == "kv":
            ranking = self.policies.kv(workers, prompt, namer.block_size if namer else 0)
        elif policy == "round-robin":
            ranking = self.policies.round_robin(workers)
        elif policy == "least-load":
            ranking = self.policies.least_load(workers)
        else:
            key = body.get("user") if isinstance(body, dict) else None
            ranking = self.policies.session(workers, headers.get(SESSION_HEADER) or key)
        return ranking, prompt

    def predict(self, worker: Worker, prompt: PromptBlocks | None) -> Holding | None:
        """What `worker` holds of the prompt, read before the request is sent: once it
        runs there, its own blocks' events would count as predicted."""
        if prompt is None or worker.info is None:
            return None
        return self.index.holdings([worker.url], prompt.blocks)[worker.url]

    def count_prediction(self, worker: Worker, holding: Holding | None) -> None:
        self.metrics.decisions.labels(self.config.policy, worker.url).inc()
        if holding is None or worker.info is None:
            return
        block_size = worker.info.block_size
        self.metrics.predicted_cached.labels(worker.url, "device").inc(holding.device * block_size)
        for tier, blocks in holding.loadable.items():
            self.metrics.predicted_cached.labels(worker.url, tier).inc(blocks * block_size)


def build_router_app(config: RouterConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) as client:
            router = app.state.router = Router(config, client)
            await router.pool.check_all()
            checks = asyncio.create_task(router.pool.run(config.health_check_interval))
            try:
                yield
            finally:
                checks.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await checks
                router.pool.close()

    app = FastAPI(title="kvtier router", summary="OpenAI-compatible front over kvtier instances", lifespan=lifespan)
    install_error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _forward(app.state.router, request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _forward(app.state.router, request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        router: Router = app.state.router
        for worker in router.pool.healthy():
            with contextlib.suppress(httpx.HTTPError):
                answer = await router.client.get(f"{worker.url}/v1/models", headers=_request_headers(request))
                return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        raise _no_instance()

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 while at least one instance is in the pool."""
        router: Router = app.state.router
        body = {"instances": {w.url: "healthy" if w.healthy else "unhealthy" for w in router.pool.workers}}
        return JSONResponse(body, status_code=200 if router.pool.healthy() else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(app.state.router.metrics.render(), media_type=CONTENT_TYPE)

    return app


async def _forward(router: Router, request: Request, path: str) -> Response:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        body = None  # the instance answers it with its own 400
    urls = router.config.worker_urls
    if router.config.prefill_urls:
        if isinstance(body, dict):
            await _prefill(router, request, path, body)
        urls = router.config.decode_urls
    ranking, prompt = await router.rank(path, body, request.headers, urls)
    if not ranking:
        router.metrics.unrouted.inc()
        raise _no_instance()
    headers = _request_headers(request)
    streamed = isinstance(body, dict) and bool(body.get("stream"))
    for attempt, worker in enumerate(ranking[:ATTEMPTS]):
        last = attempt == min(len(ranking), ATTEMPTS) - 1
        worker.in_flight += 1
        holding = router.predict(worker, prompt)
        try:
            answer = await router.client.send(
                router.client.build_request("POST", worker.url + path, content=raw, headers=headers), stream=True)
        except httpx.TransportError as exc:
            worker.in_flight -= 1
            log.warning("router: %s failed before answering (%s)", worker.url, exc)
            router.pool.leave(worker)
            if last:
                raise _no_instance() from None
            router.metrics.retries.inc()
            continue
        if answer.status_code >= 500 and not last:
            await answer.aclose()
            worker.in_flight -= 1
            router.metrics.retries.inc()
            continue
        router.count_prediction(worker, holding)
        if streamed:
            return StreamingResponse(_relay(answer, worker), status_code=answer.status_code,
                                     headers=_response_headers(answer))
        try:
            content = await answer.aread()
        finally:
            await answer.aclose()
            worker.in_flight -= 1
        _count_reported(router, worker, content)
        return Response(content, answer.status_code, headers=_response_headers(answer))
    raise _no_instance()


async def _prefill(router: Router, request: Request, path: str, body: dict[str, Any]) -> None:
    """Disaggregation's first half: the prompt alone (one output token) on a prefill
    instance, answered once its KV is in the shared tier (engine/server/handover.py). Its
    answer is dropped; whatever fails here, the decode instance computes what it misses."""
    ranking, prompt = await router.rank(path, body, request.headers, router.config.prefill_urls)
    prefill = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    prefill.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    for worker in ranking[:ATTEMPTS]:
        worker.in_flight += 1
        holding = router.predict(worker, prompt)
        try:
            answer = await router.client.post(worker.url + path, json=prefill, headers=_request_headers(request))
        except httpx.TransportError as exc:
            log.warning("router: prefill instance %s failed (%s)", worker.url, exc)
            router.pool.leave(worker)
            router.metrics.retries.inc()
            continue
        finally:
            worker.in_flight -= 1
        router.count_prediction(worker, holding)
        if answer.status_code >= 500:
            router.metrics.retries.inc()
            continue
        return


async def _relay(answer: httpx.Response, worker: Worker) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    finally:
        await answer.aclose()
        worker.in_flight -= 1


def _count_reported(router: Router, worker: Worker, content: bytes) -> None:
    try:
        usage = json.loads(content).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (ValueError, AttributeError):
        return
    router.metrics.reported_cached.labels(worker.url).inc(cached)


def _request_headers(request: Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_REQUEST_HEADERS if name in request.headers}


def _response_headers(answer: httpx.Response) -> dict[str, str]:
    return {name: answer.headers[name] for name in FORWARDED_RESPONSE_HEADERS if name in answer.headers}


def _no_instance() -> APIError:
    return APIError(503, "no kvtier instance is available (see the router's /health)", type=SERVER_ERROR,
                    code="no_instance")


def serve_router(config: RouterConfig) -> int:
    """Run the router until SIGINT/SIGTERM."""
    logging.basicConfig(level="INFO", format="%(levelname)s %(name)s: %(message)s")
    disable_created_metrics()
    check_roles(config)
    sock = bind_socket(config.host, config.port)
    print(f"kvtier router\n  policy   {config.policy}\n  workers  {' '.join(config.worker_urls)}\n"
          f"  URL      http://{config.host}:{sock.getsockname()[1]}", flush=True)
    uvicorn.Server(uvicorn.Config(build_router_app(config), log_level="warning")).run(sockets=[sock])
    return 0
