"""`kvtier router`: the OpenAI-compatible front (uvicorn; the forwarded routes plain ASGI,
the rest FastAPI) that sends each request to one instance, over the router's own kept-alive
connections (upstream.py), and passes its answer through as it arrives.

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
import gc
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import disable_created_metrics

from engine.config import RouterConfig
from engine.router.fleet_index import FleetIndex, Holding
from engine.router.metrics import CONTENT_TYPE, RouterMetrics
from engine.router.naming import PromptBlocks, RequestNamer
from engine.router.policies import Policies
from engine.router.roles import check_roles, role_conflict
from engine.router.upstream import Answer, UpstreamError
from engine.router.workers import Worker, WorkerPool
from engine.server.errors import SERVER_ERROR, APIError, install_error_handlers
from engine.server.instance_info import InstanceInfo
from engine.server.listen import bind_socket

log = logging.getLogger(__name__)

FORWARDED_PATHS = frozenset(("/v1/completions", "/v1/chat/completions"))
FORWARDED_REQUEST_HEADERS = (b"authorization", b"content-type", b"x-request-id")
FORWARDED_RESPONSE_HEADERS = (b"content-type", b"retry-after", b"cache-control", b"x-request-id")
SESSION_HEADER = b"x-session-id"
# fields of a request that its prefill-only copy leaves out (it is answered whole, one token)
PREFILL_DROPPED = ("stream", "stream_options", "max_completion_tokens", "logprobs", "top_logprobs")
ATTEMPTS = 2  # the first choice, then one other instance

Headers = list[tuple[bytes, bytes]]


class Router:
    """The pool, the index, the policies and the namers (one per model fingerprint)."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.index = FleetIndex()
        self.namers: dict[str, RequestNamer] = {}
        self._namer_lock = threading.Lock()
        self.pool = WorkerPool(config.all_urls, self.index, self._add_namer,
                               lambda url, info: role_conflict(config, url, info))
        self.policies = Policies(self.index)
        self.metrics = RouterMetrics(lambda: self.pool.workers, self.index)

    def _add_namer(self, info: InstanceInfo) -> None:
        """Called from worker threads, for instances joining at once: one at a time
        builds a fingerprint's namer, once (transformers' lazy modules, first imported
        by two threads at once, can fail)."""
        with self._namer_lock:
            if info.fingerprint not in self.namers:
                self.namers[info.fingerprint] = RequestNamer(info)
                gc.freeze()  # its tokenizer is here to stay (see _freeze_heap)

    async def rank(
        self, path: str, body: Any, session: str | None, urls: Collection[str]
    ) -> tuple[list[Worker], PromptBlocks | None]:
        """The instances of `urls` in the pool, best first for this request, and its
        prompt's blocks when known. `session`: the request's X-Session-ID header."""
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
            ranking = self.policies.session(workers, session or key)
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


class RouterApp:
    """The router's ASGI application. The forwarded routes (FORWARDED_PATHS) are served
    here, as plain ASGI; everything else (the lifespan, /health, /metrics, /v1/models,
    unknown paths) by a FastAPI app. A forwarded request would otherwise pass through
    FastAPI's middleware, routing and a StreamingResponse (whose task group listens for
    the client's disconnect) on the event loop that relays every stream: that costs
    several times what the router's own work on a request does."""

    def __init__(self, config: RouterConfig) -> None:
        self.api = _build_api(config)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] not in FORWARDED_PATHS:
            await self.api(scope, receive, send)
            return
        started = False

        async def tracked_send(message: dict) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            if scope["method"] != "POST":
                raise APIError(405, "Method Not Allowed", headers={"Allow": "POST"})
            await _forward(self.api.state.router, scope, receive, tracked_send)
        except APIError as exc:
            if started:
                raise
            await exc.to_response()(scope, receive, send)
        except Exception:
            if started:
                raise
            log.exception("router: unhandled error on %s %s", scope["method"], scope["path"])
            await APIError(500, "Internal server error.", type=SERVER_ERROR).to_response()(scope, receive, send)


def build_router_app(config: RouterConfig) -> RouterApp:
    return RouterApp(config)


def _build_api(config: RouterConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        router = app.state.router = Router(config)
        await router.pool.check_all()
        _freeze_heap()
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

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        router: Router = app.state.router
        for worker in router.pool.healthy():
            with contextlib.suppress(UpstreamError):
                answer = await worker.upstream.request("GET", "/v1/models", _request_headers(request.headers.raw))
                try:
                    content = await answer.read()
                finally:
                    answer.close()
                media_type = answer.headers.get(b"content-type")
                return Response(content, answer.status, media_type=media_type.decode() if media_type else None)
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


async def _forward(router: Router, scope: dict, receive: Callable, send: Callable) -> None:
    """One forwarded request, from its body to the end of the answer relayed. A client
    that disconnects meanwhile cancels it, which closes the connection to the instance
    (the instance then stops the request)."""
    raw = await _read_body(receive)
    if raw is None:
        return  # the client left before sending its body
    path = scope["path"]
    started = time.perf_counter()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        body = None  # the instance answers it with its own 400
    parsed_s = time.perf_counter() - started
    headers = _request_headers(scope["headers"])
    task = asyncio.current_task()
    finished = False

    def on_client_message(watch: asyncio.Future) -> None:
        if not finished and task is not None and not watch.cancelled():
            task.cancel()  # only a disconnect can come after the whole body

    watch = asyncio.ensure_future(receive())
    watch.add_done_callback(on_client_message)
    try:
        urls = router.config.worker_urls
        if router.config.prefill_urls:
            if isinstance(body, dict):
                await _prefill(router, path, body, scope["headers"])
            urls = router.config.decode_urls
        ranking_started = time.perf_counter()
        ranking, prompt = await router.rank(path, body, _session(scope["headers"]), urls)
        router.metrics.routing.observe(parsed_s + time.perf_counter() - ranking_started)
        if not ranking:
            router.metrics.unrouted.inc()
            raise _no_instance()
        streamed = isinstance(body, dict) and bool(body.get("stream"))
        for attempt, worker in enumerate(ranking[:ATTEMPTS]):
            last = attempt == min(len(ranking), ATTEMPTS) - 1
            holding = router.predict(worker, prompt)
            worker.in_flight += 1
            try:
                try:
                    answer = await worker.upstream.request("POST", path, headers, raw)
                except UpstreamError as exc:
                    log.warning("router: %s failed before answering (%s)", worker.url, exc)
                    router.pool.leave(worker)
                    if last:
                        raise _no_instance() from None
                    router.metrics.retries.inc()
                    continue
                try:
                    if answer.status >= 500 and not last:
                        router.metrics.retries.inc()
                        continue
                    router.count_prediction(worker, holding)
                    if streamed:
                        await _relay(answer, worker, send)
                    else:
                        await _answer_whole(router, answer, worker, send)
                    finished = True
                    return
                finally:
                    answer.close()
            finally:
                worker.in_flight -= 1
        raise _no_instance()
    except asyncio.CancelledError:
        if task is None or not watch.done() or watch.cancelled() or task.uncancel():
            raise  # cancelled by someone else (the server shutting down)
        log.info("router: the client left before its answer ended")
    finally:
        finished = True
        watch.cancel()


async def _relay(answer: Answer, worker: Worker, send: Callable) -> None:
    """The instance's answer passed on as it arrives, each piece as soon as it comes. An
    instance that breaks off leaves the answer unfinished: uvicorn then closes the
    client's connection, which tells the client the stream was cut short."""
    await send({"type": "http.response.start", "status": answer.status, "headers": _response_headers(answer)})
    try:
        async for chunk in answer.chunks():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except UpstreamError as exc:
        log.warning("router: %s broke off a streamed answer (%s)", worker.url, exc)
        return
    await send({"type": "http.response.body", "body": b""})


async def _answer_whole(router: Router, answer: Answer, worker: Worker, send: Callable) -> None:
    """A non-streamed answer, read whole first (its usage is counted)."""
    try:
        content = await answer.read()
    except UpstreamError as exc:
        log.warning("router: %s broke off its answer (%s)", worker.url, exc)
        raise APIError(502, f"the instance broke off its answer ({exc})", type=SERVER_ERROR,
                       code="instance_error") from None
    _count_reported(router, worker, content)
    headers = [*_response_headers(answer), (b"content-length", str(len(content)).encode())]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": content})


async def _prefill(router: Router, path: str, body: dict[str, Any], client_headers: Headers) -> None:
    """Disaggregation's first half: the prompt alone (one output token) on a prefill
    instance, answered once its KV is in the shared tier (engine/server/handover.py). Its
    answer is dropped; whatever fails here, the decode instance computes what it misses."""
    ranking, prompt = await router.rank(path, body, _session(client_headers), router.config.prefill_urls)
    prefill = {key: value for key, value in body.items() if key not in PREFILL_DROPPED}
    prefill.update(max_tokens=1, n=1, kv_transfer_params={"do_remote_decode": True})
    content = json.dumps(prefill).encode()
    headers = [(name, value) for name, value in _request_headers(client_headers) if name != b"content-type"]
    headers.append((b"content-type", b"application/json"))
    for worker in ranking[:ATTEMPTS]:
        holding = router.predict(worker, prompt)
        worker.in_flight += 1
        try:
            answer = await worker.upstream.request("POST", path, headers, content)
            try:
                await answer.read()
            finally:
                answer.close()
        except UpstreamError as exc:
            log.warning("router: prefill instance %s failed (%s)", worker.url, exc)
            router.pool.leave(worker)
            router.metrics.retries.inc()
            continue
        finally:
            worker.in_flight -= 1
        router.count_prediction(worker, holding)
        if answer.status >= 500:
            router.metrics.retries.inc()
            continue
        return


def _freeze_heap() -> None:
    """Take what is alive once the router has started (its modules, the namers'
    tokenizers: hundreds of thousands of objects) out of the garbage collector's reach.
    A full collection walks every tracked object, with the GIL held, on the loop that
    relays every stream; frozen, it walks only what requests left behind."""
    gc.collect()
    gc.freeze()


async def _read_body(receive: Callable) -> bytes | None:
    """The request's whole body, or None when the client disconnects first."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)


def _count_reported(router: Router, worker: Worker, content: bytes) -> None:
    try:
        usage = json.loads(content).get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    except (ValueError, AttributeError):
        return
    router.metrics.reported_cached.labels(worker.url).inc(cached)


def _request_headers(headers: Headers) -> Headers:
    """The client's headers passed to the instance."""
    return [(name, value) for name, value in headers if name in FORWARDED_REQUEST_HEADERS]


def _session(headers: Headers) -> str | None:
    return next((value.decode("latin-1") for name, value in headers if name == SESSION_HEADER), None)


def _response_headers(answer: Answer) -> Headers:
    return [(name, answer.headers[name]) for name in FORWARDED_RESPONSE_HEADERS if name in answer.headers]


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
