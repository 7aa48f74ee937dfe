"""The server's own flags of `kvtier serve` (the engine flags come from engine.arg_utils)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine.config import ConfigError, parse_size
from engine.server.auth import API_KEY_ENVS

ADMIN_TOKEN_ENV = "KVTIER_ADMIN_TOKEN"
MIN_ADMIN_TOKEN_CHARS = 16
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    enable_kv_admin: bool = False
    admin_token: str | None = None
    max_waiting_requests: int = 256
    max_prompts_per_request: int = 64
    max_request_bytes: int = 8 * 1024**2
    body_read_timeout: float = 30.0
    max_body_reads_per_client: int = 16
    retry_after: int = 1
    shutdown_timeout: float = 30.0
    log_level: str = "info"

    def queue_size(self, max_num_seqs: int) -> int:
        """Requests admitted at once: the running ones plus the waiting ones."""
        return max_num_seqs + self.max_waiting_requests

    def prompt_limit(self, max_num_seqs: int) -> int:
        """Most prompts in one completion: the flag, never more than the queue holds."""
        return min(self.max_prompts_per_request, self.queue_size(max_num_seqs))

    def validate(self) -> None:
        if self.enable_kv_admin and not self.admin_token:
            raise ConfigError(
                "admin_token",
                f"--enable-kv-admin needs a token (--admin-token or ${ADMIN_TOKEN_ENV}): "
                "the KV admin API is never served unauthenticated",
            )
        if self.enable_kv_admin and len(self.admin_token) < MIN_ADMIN_TOKEN_CHARS:
            raise ConfigError("admin_token", f"must be at least {MIN_ADMIN_TOKEN_CHARS} characters")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", f"must be in 0..65535, got {self.port}")
        if self.max_waiting_requests < 0:
            raise ConfigError("max_waiting_requests", f"must be >= 0, got {self.max_waiting_requests}")
        if self.max_prompts_per_request < 1:
            raise ConfigError("max_prompts_per_request", f"must be >= 1, got {self.max_prompts_per_request}")
        if self.max_request_bytes < 1024:
            raise ConfigError("max_request_bytes", f"must be at least 1KiB, got {self.max_request_bytes}")
        if not self.body_read_timeout > 0:
            raise ConfigError("body_read_timeout", f"must be > 0, got {self.body_read_timeout}")
        if self.max_body_reads_per_client < 1:
            raise ConfigError("max_body_reads_per_client", f"must be >= 1, got {self.max_body_reads_per_client}")
        if self.retry_after < 0:
            raise ConfigError("retry_after", f"must be >= 0, got {self.retry_after}")
        if self.shutdown_timeout < 0:
            raise ConfigError("shutdown_timeout", f"must be >= 0, got {self.shutdown_timeout}")


def _size(text: str) -> int:
    try:
        return parse_size(text, "max_request_bytes")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from None


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the HTTP server flags of `kvtier serve`."""
    defaults = ServerSettings()
    group = parser.add_argument_group("server options")
    group.add_argument("--host", default=defaults.host,
                       help="Address to bind. The default serves this machine only; use 0.0.0.0 "
                       "to serve the network (default: %(default)s).")
    group.add_argument("--port", type=int, default=defaults.port,
                       help="TCP port; 0 picks a free one, printed at startup (default: %(default)s).")
    group.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None,
                       help="Model name(s) clients put in the `model` field: /v1/models lists "
                       "them all, requests may use any, responses report the first (default: the "
                       "MODEL value, or builtin:smollm2). Give MODEL before this flag.")
    group.add_argument("--api-key", default=_env_api_key(), metavar="KEY",
                       help="Require `Authorization: Bearer KEY` on every /v1/ request (401 "
                       "otherwise); /health, /ready, /metrics and /version stay open "
                       f"(default: ${API_KEY_ENVS[0]}, else ${API_KEY_ENVS[1]}; prefer the "
                       "variables, command lines are visible to other users).")
    group.add_argument("--enable-kv-admin", action="store_true",
                       help="Serve the KV admin API under /kv/ (stats, pin, unpin, flush). "
                       "Requires --admin-token.")
    group.add_argument("--admin-token", default=os.environ.get(ADMIN_TOKEN_ENV), metavar="TOKEN",
                       help=f"Bearer token of the KV admin API, at least {MIN_ADMIN_TOKEN_CHARS} "
                       f"characters (default: ${ADMIN_TOKEN_ENV}; prefer the variable, command "
                       "lines are visible to other users).")
    group.add_argument("--max-waiting-requests", type=int, default=defaults.max_waiting_requests, metavar="N",
                       help="Requests that may wait beyond the --max-num-seqs running ones; "
                       "past that the server answers 503 with Retry-After (default: %(default)s).")
    group.add_argument("--max-prompts-per-request", type=int, default=defaults.max_prompts_per_request,
                       metavar="N",
                       help="Most prompts in one completion request; more get 400 before any is "
                       "tokenized. Never more than --max-num-seqs + --max-waiting-requests: a "
                       "request's prompts are admitted together or not at all (default: %(default)s).")
    group.add_argument("--max-request-bytes", type=_size, default=defaults.max_request_bytes,
                       metavar="SIZE",
                       help="Largest request body, e.g. 8MiB; larger ones get 413 (default: 8MiB).")
    group.add_argument("--body-read-timeout", type=float, default=defaults.body_read_timeout,
                       metavar="SECONDS",
                       help="A request body must have fully arrived this long after the request "
                       "head, or the server answers 408 and closes the connection "
                       "(default: %(default)s).")
    group.add_argument("--max-body-reads-per-client", type=int, default=defaults.max_body_reads_per_client,
                       metavar="N",
                       help="Request bodies one client address may be sending at once; one more gets "
                       "503 with Retry-After (bodies sent at network speed never wait, so only "
                       "slow senders count) (default: %(default)s).")
    group.add_argument("--retry-after", type=int, default=defaults.retry_after, metavar="SECONDS",
                       help="Retry-After of 503 answers when the queue is full (default: %(default)s).")
    group.add_argument("--shutdown-timeout", type=float, default=defaults.shutdown_timeout,
                       metavar="SECONDS",
                       help="On SIGINT/SIGTERM, how long in-flight requests may finish before "
                       "they are aborted (default: %(default)s).")
    group.add_argument("--log-level", choices=LOG_LEVELS, default=defaults.log_level,
                       help="Server log level (default: %(default)s).")


def _env_api_key() -> str | None:
    return next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    """Build and validate the settings; a bad value raises ConfigError naming the flag."""
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        served_model_names=tuple(args.served_model_name or ()),
        api_key=args.api_key or None,
        enable_kv_admin=args.enable_kv_admin,
        admin_token=args.admin_token or None,
        max_waiting_requests=args.max_waiting_requests,
        max_prompts_per_request=args.max_prompts_per_request,
        max_request_bytes=args.max_request_bytes,
        body_read_timeout=args.body_read_timeout,
        max_body_reads_per_client=args.max_body_reads_per_client,
        retry_after=args.retry_after,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
    )
    settings.validate()
    return settings
