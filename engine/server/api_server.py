"""`kvtier serve`: the OpenAI-compatible FastAPI app, its routes, and the process lifecycle
(bind, load, print the summary, run uvicorn, shut down on SIGINT/SIGTERM)."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import TYPE_CHECKING, Annotated

import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import disable_created_metrics

from engine import __version__
from engine.config import EngineConfig, ServerConfig, redact_url, resident_memory
from engine.server import admin, tokenize_api
from engine.server.auth import ApiKeyMiddleware
from engine.server.body_decoder import BodyDecoder
from engine.server.errors import APIError, install_error_handlers
from engine.server.instance_info import InstanceInfo, InstanceLoad, instance_load
from engine.server.listen import bind_socket
from engine.server.middleware import BodyLimitsMiddleware
from engine.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from engine.server.request_body import json_body
from engine.server.serving import create_chat_completion, create_completion
from engine.server.state import ServerState, create_state, default_model_names
from kvstore.config import REMOTE_TIERS

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.kvtier


def _body_decoder(request: Request) -> BodyDecoder:
    return _state(request).body_decoder


# Big bodies are decoded off the event loop (engine/server/request_body.py).
CompletionBody = Annotated[CompletionRequest, Depends(json_body(CompletionRequest, _body_decoder))]
ChatCompletionBody = Annotated[ChatCompletionRequest, Depends(json_body(ChatCompletionRequest, _body_decoder))]


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionBody) -> Response:
    state = _state(request)
    state.check_prompt_count(body.num_prompts)  # before any prompt is tokenized
    return await create_completion(state, body, request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionBody) -> Response:
    return await create_chat_completion(_state(request), body, request)


@router.get("/v1/models")
async def models(request: Request) -> ModelList:
    state = _state(request)
    cards = [
        ModelCard(id=name, created=state.created, root=state.model_root, max_model_len=state.max_model_len)
        for name in state.model_names
    ]
    return ModelList(data=cards)


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """Liveness: 200 while the engine runs, with `status` "degraded" (and which tier)
    while an offload tier does not answer; 503 once the engine is gone."""
    state = _state(request)
    if not state.engine.is_healthy:
        raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")
    return JSONResponse(_health_body(state))


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """Readiness for a load balancer: 200 when the engine runs and every tier of
    `--ready-requires-tiers` answers (default: the local ones); 503 (same body as /health,
    plus `ready_requires_tiers`) while one of those does not, and back by itself when it
    recovers. A shared remote tier is not required by default: when it goes down every
    instance still serves, recomputing, and a 503 from all of them would be a full outage."""
    state = _state(request)
    if not state.engine.is_healthy:
        raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")
    body = _health_body(state)
    required = _ready_requires(state)
    body["ready_requires_tiers"] = list(required)
    down = set(required) & set(body["unhealthy_tiers"])
    return JSONResponse(body, status_code=503 if down else 200)


def _ready_requires(state: ServerState) -> tuple[str, ...]:
    """The configured tiers whose outage fails /ready: those `--ready-requires-tiers`
    names, by default every tier but the remote (shared) one."""
    named = state.settings.ready_requires_tiers
    return tuple(t for t in state.kv_offload if (t not in REMOTE_TIERS if named is None else t in named))


def _health_body(state: ServerState) -> dict:
    tiers = state.tier_health()
    down = [name for name, health in tiers.items() if health != "healthy"]
    return {"status": "degraded" if down else "ok", "kv_tiers": tiers, "unhealthy_tiers": down}


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": __version__}


@router.get("/instance")
async def instance(request: Request) -> InstanceInfo:
    """What `kvtier router` needs to route here by cache (engine/server/instance_info.py)."""
    return _state(request).instance


@router.get("/load")
async def load(request: Request) -> InstanceLoad:
    """The engine's load for a router's periodic check (engine/server/instance_info.py);
    503 once the engine is gone, as /health."""
    state = _state(request)
    if not state.engine.is_healthy:
        raise APIError(503, "the engine is not running", type="server_error", code="engine_unavailable")
    return instance_load(state.instance.instance_id, state.engine.stats)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = _state(request).metrics.render()
    return Response(body, media_type=content_type)


class EngineStopper:
    """Stops the engine once, from whichever asks first: the signal (`_Server.handle_exit`)
    or the end of the app (its lifespan)."""

    def __init__(self, state: ServerState) -> None:
        self._state = state
        self._stopping: asyncio.Future[None] | None = None
        self._graceful = False

    def stop(self, graceful: bool) -> asyncio.Future[None]:
        """Stop accepting; if `graceful`, let running requests finish for --shutdown-timeout
        seconds; then abort the rest, which ends each open stream with a final `abort` chunk.
        A stop that is not graceful cuts a graceful one short (Ctrl-C during a drain)."""
        if self._stopping is None or (self._graceful and not graceful):
            timeout = self._state.settings.shutdown_timeout
            self._graceful = graceful
            self._stopping = asyncio.ensure_future(self._state.engine.shutdown(graceful=graceful, timeout=timeout))
        return self._stopping


# After the engine aborted what was left, how long uvicorn waits for the aborted streams
# to send their last chunk and close, before it cancels them itself.
STREAM_CLOSE_S = 10.0


class _Server(uvicorn.Server):
    """uvicorn, which on SIGINT or SIGTERM also stops the engine at once instead of after
    every connection closed: SIGTERM drains (running requests get --shutdown-timeout to
    finish), SIGINT (Ctrl-C, someone at a terminal) aborts them now. Either way each open
    stream then ends with a final chunk (`finish_reason: "abort"`) and `[DONE]`, so
    uvicorn never has to cancel one (a CancelledError traceback, the client cut off)."""

    def __init__(self, config: uvicorn.Config, stopper: EngineStopper) -> None:
        super().__init__(config)
        self._stopper = stopper

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        try:
            loop = asyncio.get_running_loop()  # the handler runs on the loop's (main) thread
        except RuntimeError:
            return  # not serving yet, or any more: nothing to stop
        loop.call_soon_threadsafe(self._stopper.stop, sig != signal.SIGINT)


def build_app(state: ServerState, on_ready: Callable[[], None] | None = None) -> tuple[FastAPI, EngineStopper]:
    """The ASGI app around a ready ServerState, and what stops its engine (the app's end
    does, if nothing did before). `on_ready` runs once the app serves."""
    stopper = EngineStopper(state)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield
        await stopper.stop(graceful=True)
        state.body_decoder.close()

    app = FastAPI(title="kvtier", summary="OpenAI-compatible server of the kvtier engine", lifespan=lifespan)
    app.state.kvtier = state
    install_error_handlers(app)
    app.include_router(router)
    app.include_router(tokenize_api.router)  # /tokenize, /detokenize
    if state.settings.enable_kv_admin:
        app.include_router(admin.router)
    settings = state.settings
    app.add_middleware(
        BodyLimitsMiddleware, max_bytes=settings.max_request_bytes, timeout_s=settings.body_read_timeout,
        max_reads_per_client=settings.max_body_reads_per_client, retry_after_s=settings.retry_after,
        on_refusal=state.metrics.count_rejection,
    )
    if settings.api_key:  # added last, so it runs first: an unauthenticated body is never read
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key)
    return app, stopper


def serve(config: EngineConfig, settings: ServerConfig, on_ready: Callable[[], None] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM; returns the process exit status. uvicorn
    handles both signals while it runs and raises them again once it has shut down: the
    caller's handlers decide then (engine.cli's end the process with 130 and 0).
    `on_ready` runs once the server takes requests."""
    logging.basicConfig(level=settings.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    disable_created_metrics()
    sock = bind_socket(settings.host, settings.port)
    names = settings.served_model_name or default_model_names(config.model)
    state = create_state(config, settings, names)
    print(startup_summary(state.engine.engine, settings, names, _url(settings.host, sock.getsockname()[1])), flush=True)
    app, stopper = build_app(state, on_ready)
    server = _Server(uvicorn.Config(
        app, log_level=settings.log_level, timeout_graceful_shutdown=settings.shutdown_timeout + STREAM_CLOSE_S,
    ), stopper)
    server.run(sockets=[sock])
    return 0


def startup_summary(engine: LLMEngine, settings: ServerConfig, names: tuple[str, ...], url: str) -> str:
    spec, config = engine.spec, engine.config
    pool_tokens = engine.num_kv_blocks * config.block_size
    lines = [
        "kvtier serve",
        f"  model    {engine.model_path} ({spec.architecture}, {spec.num_layers} layers, "
        f"vocab {spec.vocab_size}) served as {', '.join(names)}",
        f"  dtype    {str(engine.dtype).removeprefix('torch.')} on {engine.device}",
        *([f"  threads  {engine.thread_plan.summary()}{', seat keeper on' if engine.seat_keeper else ''}"]
          if engine.thread_plan is not None else []),
        f"  KV pool  {engine.num_kv_blocks} blocks x {config.block_size} tokens = {pool_tokens} tokens "
        f"({format_bytes(engine.num_kv_blocks * engine.block_bytes)}), max model len {config.max_model_len}",
        f"  offload  {_offload_summary(config)}",
        f"  memory   {_memory_summary(engine)}",
        f"  queue    {config.max_num_seqs} running + {settings.max_waiting_requests} waiting requests, "
        f"{settings.prompt_limit(config.max_num_seqs)} prompts per request at most",
        f"  API key  {'required on /v1/' if settings.api_key else 'none (any client is served)'}",
        f"  admin    {'/kv/ (bearer token)' if settings.enable_kv_admin else 'off'}",
        f"  URL      {url}",
    ]
    return "\n".join(lines)


def _memory_summary(engine: LLMEngine) -> str:
    """What the process holds from now on: its resident memory (the cpu tier is faulted
    in by the time the summary prints) and what it is made of."""
    config = engine.config
    parts = ["weights", f"KV pool {format_bytes(engine.num_kv_blocks * engine.block_bytes)}"
             + (f" (on {engine.device})" if engine.device.type != "cpu" else "")]
    if "cpu" in config.kv_offload:
        parts.append(f"cpu tier {format_bytes(config.kv_offload_cpu_size)}")
    resident = resident_memory()
    held = f"{format_bytes(resident)} resident" if resident is not None else "resident size unknown"
    return f"{held}, held while it serves: {', '.join(parts)}"


def _offload_summary(config: EngineConfig) -> str:
    tiers = {
        "cpu": f"cpu {format_bytes(config.kv_offload_cpu_size)}",
        "disk": f"disk {format_bytes(config.kv_offload_disk_size)} at {config.disk_path}",
        "redis": f"redis {redact_url(config.kv_redis_url or '')}",
    }
    return "; ".join(tiers[t] for t in config.kv_offload) or "none"


def format_bytes(size: int) -> str:
    """1536 -> '1.5 KiB'."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    exponent = min(max(size.bit_length() - 1, 0) // 10, len(units) - 1)
    if exponent == 0:
        return f"{size} B"
    return f"{size / 1024**exponent:.1f} {units[exponent]}"


def _url(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
