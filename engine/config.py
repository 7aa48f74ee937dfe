"""The config tree: every engine, store and server option, defined once.

Sections are pydantic models (`ModelOptions`, `SchedulerOptions`, `StoreOptions`,
`ServerConfig`); `EngineConfig` is the model, scheduler and store sections together, what
`LLM(...)` and `LLMEngine` take. A field is one option under three spellings: its name
is the `LLM(...)` keyword, with dashes it is the flag (`kv_offload_cpu_size` ->
`--kv-offload-cpu-size`), and either spelling is a key of a `--config FILE.yaml`. Its
description is the flag's help; `engine.arg_utils` generates the flags from the tree.

Validation happens here and only here: a field's type (pydantic), then the checks across
fields. The store section is the store's own config (connectors.config.ConnectorConfig,
which adds the connector's options to kvstore.StoreConfig): its options, their defaults
and their checks are declared there once and included here as they are. Every failure is
a `ConfigError` naming the option.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError

from connectors.config import ConnectorConfig
from engine.cache_home import kvtier_cache_dir
from engine.cpu_threads import check_bind_value
from engine.kv_events.config import KVEventsConfig, parse_kv_events_config
from kvstore.config import TIER_ORDER, Tiers, parse_tiers
from kvstore.errors import StoreConfigError
from kvstore.options import (
    MAX_SECONDS,
    GiB,
    PathOption,
    Seconds,
    Size,
    describe_error,
    expand_path,
    format_size,
    option,
)

DTYPES = ("auto", "float32", "bfloat16", "float16")
OFFLOAD_TIERS = TIER_ORDER
ADMIN_TOKEN_ENV = "KVTIER_ADMIN_TOKEN"
API_KEY_ENVS = ("KVTIER_API_KEY", "VLLM_API_KEY")  # the first one set wins
MIN_ADMIN_TOKEN_CHARS = 16
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def flag_name(option: str) -> str:
    return "--" + option.replace("_", "-")


class ConfigError(ValueError):
    """An option has a bad value. `option` is its field name; the message names it as a
    flag (`--kv-offload-cpu-size: ...`), or as a keyword after `as_keyword()` (LLM(...))."""

    def __init__(self, option: str, message: str, *, keyword: bool = False) -> None:
        self.option, self.message, self.keyword = option, message, keyword
        super().__init__(f"{option if keyword else flag_name(option)}: {message}")

    def as_keyword(self) -> ConfigError:
        return ConfigError(self.option, self.message, keyword=True)


# Upper bounds: a value past one is a typo or an attack, never a deployment. Refused at
# start, they cannot fail (or allocate for) the first request instead.
MAX_SEQS = 16384  # sequences running in one step, or in one request's queue share
MAX_TOKENS = 2**24  # a context, a step's token budget
MAX_BLOCKS = 2**24  # device KV blocks
MAX_BLOCK_SIZE = 1024  # tokens per block
MAX_COUNT = 2**20  # other counts: queue lengths, prompts per request, logprobs, workers


def _names(value: Any) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


def _block_size(value: int) -> int:
    if value <= 0 or value & (value - 1):
        raise ValueError(f"must be a positive power of two, got {value}")
    return value


def _device(value: str) -> str:
    if value not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", value):
        raise ValueError(f"{value!r} is not auto, cpu or cuda[:N]")
    return value


Names = Annotated[tuple[str, ...], BeforeValidator(_names)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
PositiveCount = Annotated[int, Field(gt=0, le=MAX_COUNT)]

# ---- the tree -----------------------------------------------------------------------------


class Options(BaseModel):
    """A section of the tree. Construction validates every field and raises ConfigError."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), validate_default=False)
    title: ClassVar[str] = "options"

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(*describe_error(exc)) from None
        except StoreConfigError as exc:  # the store section, kvstore.StoreConfig, checks its own
            raise ConfigError(exc.option or "kv_offload", str(exc)) from None
        self.check()

    def check(self) -> None:
        """Checks across fields (after every field has its type)."""

    @classmethod
    def option_names(cls) -> list[str]:
        return list(cls.model_fields)


class ModelOptions(Options):
    title: ClassVar[str] = "model options"

    model: PathOption | None = option(
        None, "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer), a .gguf "
        "file, or builtin:NAME (see kvtier --help). Default: builtin:smollm2 (SmolLM2-135M-Instruct, "
        "installed by `kvtier download-model`).", metavar="MODEL")
    tokenizer: PathOption | None = option(None, "Tokenizer directory, when it differs from --model.", metavar="DIR")
    chat_template: str | None = option(
        None, "Chat template to use instead of the model's: a Jinja file, or the template itself "
        "(a value with braces or a newline).", metavar="TEMPLATE")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option(
        "auto", "Weights and KV-cache dtype; auto takes the checkpoint's declared dtype (a GGUF "
        "file: its float type, bfloat16 when quantized), float32 on a CPU without native matmuls "
        "for a declared bfloat16 or float16.")
    device: Annotated[str, AfterValidator(_device)] = option(
        "auto", "auto (CUDA when available), cpu, cuda or cuda:N.", metavar="DEVICE")
    cpu_threads_bind: Annotated[str, AfterValidator(check_bind_value)] = option(
        "auto", "The engine's intra-op (OpenMP) threads on CPU: auto, one per physical core the "
        "process may use (its affinity mask, capped by its cgroup's CPU quota: 1.5 CPUs run 1 "
        "thread), each bound to its core when the process was given part of the machine's CPUs "
        "(a cpuset or taskset) as whole CPUs, else unbound; none, the same count unbound; or a "
        "CPU list (0-3,8), one thread bound to each CPU listed.",
        metavar="auto|none|CPUS")
    cpu_seat_keeper: bool = option(
        False, "On CPU, beside an unbound intra-op team of two or more threads and without a cgroup CPU "
        "quota, run a child process that yields the CPU in a loop while requests run, so that the "
        "server's session stays on the run queue while its OpenMP threads sleep at barriers "
        "(engine/cpu_seat.py). It pays on a heavily oversubscribed host (many busy processes per "
        "core) and costs about a tenth of decode speed on a quiet one or beside a few neighbours "
        "(docs/notes/cpu-seat-keeper.md); it takes the spare time of one CPU while requests run. "
        "Applies where the engine manages its threads (kvtier serve and generate, or "
        "--cpu-threads-bind given).")
    # bounded to torch.manual_seed's range
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1)] = option(
        0, "Seed for weight-independent randomness (sampling without a per-request seed).")
    max_logprobs: Count = option(
        20, "Most top logprobs a request may ask for (completions `logprobs`, chat `top_logprobs`); "
        "more is refused.", metavar="N")

    def _check_model(self) -> None:
        for name in ("model", "tokenizer"):
            path = getattr(self, name)
            if path is not None and not path.startswith(BUILTIN_PREFIX) and not os.path.exists(path):
                raise ConfigError(name, missing_model_message(path))
        if self.chat_template is not None:  # a file becomes its text: a copy rebuilds the same
            self.chat_template = load_chat_template(self.chat_template)


class SchedulerOptions(Options):
    title: ClassVar[str] = "device cache and scheduler options"

    block_size: Annotated[int, Field(le=MAX_BLOCK_SIZE), AfterValidator(_block_size)] = option(
        16, "Tokens per KV-cache block (a power of two).")
    num_kv_blocks: Annotated[int, Field(gt=0, le=MAX_BLOCKS)] | None = option(
        None, "Size the device KV pool in blocks (overrides --kv-cache-memory).")
    kv_cache_memory: Size | None = option(
        None, "Size the device KV pool in memory: GiB, or with a unit (512MiB). "
        "Default: 1GiB on CPU, half the free GPU memory on CUDA.", metavar="SIZE")
    max_model_len: Annotated[int, Field(gt=0, le=MAX_TOKENS)] | None = option(
        None, "Longest prompt + output in tokens. Default: the model's max_position_embeddings.")
    max_num_seqs: Annotated[int, Field(gt=0, le=MAX_SEQS)] = option(64, "Most requests running in one step.")
    max_num_batched_tokens: Annotated[int, Field(gt=0, le=MAX_TOKENS)] = option(
        2048, "Token budget of one step (prefill chunks plus decodes).")
    enable_prefix_caching: bool = option(True, "Reuse KV blocks of identical prefixes on the device.")
    preemption_mode: Literal["offload", "recompute"] | None = option(
        None, "What happens to a preempted request's KV: offload (to the cpu tier; the default "
        "when it exists) or recompute.")
    fuse_elementwise: bool = option(
        True, "On CPU, run the RMSNorm, rotary and SiLU-and-mul of steps of 256 or more tokens "
        "as one fused pass each (compiled by torch.compile at start: about 20 s the first time on "
        "a 2-core machine, seconds once inductor's cache holds them); --no-fuse-elementwise: eager ops only.")
    attention_backend: Literal["auto", "torch", "triton", "cpu"] = option(
        "auto", "auto (Triton on CUDA; on CPU the C++ kernels, built at first use, or torch where "
        "they do not build), torch, triton or cpu.")
    kv_blend_recompute_ratio: Annotated[float, Field(ge=0, le=1)] = option(
        0.15, "Blended (segmented) prompts: the fraction of the tokens with stored segment KV "
        "that is recomputed in context (0: none, 1: a full prefill).", metavar="RATIO")
    kv_blend_separator: Annotated[str, Field(min_length=1)] | None = option(
        None, "A string that marks segment boundaries in text prompts (system prompt, documents, "
        "question): such prompts are blended, each document reusing its stored KV wherever it "
        "appears. The separator is not part of the prompt.", metavar="TEXT")


class StoreOptions(Options, ConnectorConfig):
    """The store section: the connector's and the store's options (ConnectorConfig), and
    the engine's spellings of them: a secret read from a file, vLLM's offloading flags."""

    title: ClassVar[str] = "KV store options"

    kv_secret_file: PathOption | None = option(
        None, "File holding the --kv-secret (its text without the trailing newline).", metavar="FILE")
    kv_offloading_size: Annotated[Size, Field(gt=0)] | None = option(
        None, "vLLM's spelling: GiB of cpu offload; the same as --kv-offload cpu "
        "--kv-offload-cpu-size SIZE.", metavar="GiB")
    kv_offloading_backend: Literal["native"] | None = option(
        None, "vLLM's spelling: native is kvtier's cpu tier (the same as --kv-offload cpu).")
    kv_events_config: Annotated[KVEventsConfig | None, BeforeValidator(parse_kv_events_config)] = option(
        None, "Publish KV cache events (vLLM's KVEventsConfig as JSON, e.g. "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558"}\'): blocks stored in and removed from the device pool and each tier, '
        "in vLLM's wire format (README, KV events).", metavar="JSON")

    def check_store_options(self) -> None:
        """The engine's defaults and spellings folded in, then the store's own checks."""
        if "disk" in self.kv_offload and self.kv_offload_disk_path is None:
            self.kv_offload_disk_path = default_disk_path()
        super().check_store_options()

    def _check_store(self) -> None:
        if self.kv_offloading_size is not None or self.kv_offloading_backend is not None:
            if self.kv_offloading_size is not None and "kv_offload_cpu_size" in self.model_fields_set:
                raise ConfigError("kv_offloading_size", "give it or --kv-offload-cpu-size, not both")
            if "cpu" not in self.kv_offload:
                self.kv_offload = parse_tiers(("cpu", *self.kv_offload))
            if self.kv_offloading_size is not None:
                self.kv_offload_cpu_size = self.kv_offloading_size
            self.kv_offloading_size = self.kv_offloading_backend = None  # folded in: a copy rebuilds the same
        if self.kv_secret_file is not None:
            if self.kv_secret:
                raise ConfigError("kv_secret_file", "give --kv-secret or --kv-secret-file, not both")
            self.kv_secret, self.kv_secret_file = read_secret_file(self.kv_secret_file), None
        if self.kv_role != "both" and not self.kv_offload:
            raise ConfigError("kv_role", f"{self.kv_role} needs a store to share (--kv-offload)")

    @property
    def disk_path(self) -> str:
        return self.kv_offload_disk_path or default_disk_path()


logger = logging.getLogger(__name__)
# vLLM's flags that change nothing here, and why (said once, when one is given).
_VLLM_NOTES = {
    "tensor_parallel_size": "kvtier runs one device per instance",
    "enable_chunked_prefill": "kvtier always chunks long prefills (--max-num-batched-tokens)",
    "disable_log_requests": "kvtier does not log requests",
    "trust_remote_code": "kvtier runs no code from a checkpoint, only its own model classes",
}


class VllmOptions(Options):
    """vLLM's flags that users paste into kvtier's command lines: accepted with a note
    where they change nothing here, mapped where kvtier has the same thing."""

    title: ClassVar[str] = "vLLM's flags, accepted for its command lines"

    tensor_parallel_size: Annotated[int, Field(ge=1, le=MAX_COUNT)] | None = option(
        None, "vLLM's; kvtier runs one device per instance, so only 1 is accepted.", metavar="1")
    enable_chunked_prefill: bool | None = option(
        None, "vLLM's; kvtier always chunks long prefills (by --max-num-batched-tokens): accepted, "
        "--no-enable-chunked-prefill refused.")
    disable_log_requests: bool | None = option(None, "vLLM's; kvtier does not log requests: accepted.")
    trust_remote_code: bool | None = option(
        None, "vLLM's; kvtier runs no code from a checkpoint (its own model classes): accepted.")
    enforce_eager: bool | None = option(None, "vLLM's; the same as --no-fuse-elementwise (no torch.compile).")
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] | None = option(
        None, "vLLM's: the share of the device's memory (of the host's memory on CPU) this "
        "instance may hold; the KV pool gets what the weights leave of it. Instead of "
        "--kv-cache-memory and --num-kv-blocks.", metavar="SHARE")

    def _check_vllm(self) -> None:
        """Note the flags that change nothing, map --enforce-eager, refuse what kvtier
        cannot do; then fold them away, so that a copy rebuilds the same config silently."""
        if self.tensor_parallel_size not in (None, 1):
            raise ConfigError("tensor_parallel_size", f"{_VLLM_NOTES['tensor_parallel_size']}; only 1 is accepted, "
                              f"got {self.tensor_parallel_size}")
        if self.enable_chunked_prefill is False:
            raise ConfigError("enable_chunked_prefill", f"{_VLLM_NOTES['enable_chunked_prefill']}; it cannot be off")
        for name, why in _VLLM_NOTES.items():
            if getattr(self, name) is not None:
                logger.warning("%s: accepted, changes nothing (%s)", flag_name(name), why)
                setattr(self, name, None)
        if self.enforce_eager is not None:
            if self.enforce_eager and "fuse_elementwise" in self.model_fields_set and self.fuse_elementwise:
                raise ConfigError("enforce_eager", "give it or --fuse-elementwise, not both")
            if self.enforce_eager:
                logger.warning("--enforce-eager: running as --no-fuse-elementwise")
                self.fuse_elementwise = False
            self.enforce_eager = None
        if self.gpu_memory_utilization is not None:
            given = [name for name in ("kv_cache_memory", "num_kv_blocks") if getattr(self, name) is not None]
            if given:
                raise ConfigError("gpu_memory_utilization", f"give it or {flag_name(given[0])}, not both")


class EngineConfig(ModelOptions, SchedulerOptions, StoreOptions, VllmOptions):
    """Every option of an engine: `LLM(...)`'s keywords. `model=None` means the built-in
    default (builtin:smollm2)."""

    def check(self) -> None:
        self._check_model()
        self._check_store()
        self._check_vllm()
        if self.preemption_mode == "offload" and "cpu" not in self.kv_offload:
            raise ConfigError("preemption_mode", "offload needs the cpu tier (--kv-offload cpu,...)")
        if self.preemption_mode == "offload" and self.kv_role != "both":
            raise ConfigError("preemption_mode", f"offload saves and loads a preempted request's KV; "
                              f"--kv-role {self.kv_role} does only one of them")
        if self.kv_chunk_tokens % self.block_size:
            raise ConfigError(
                "kv_chunk_tokens",
                f"must be a multiple of --block-size ({self.block_size}), got {self.kv_chunk_tokens}",
            )

    @property
    def effective_preemption_mode(self) -> str:
        if self.preemption_mode:
            return self.preemption_mode
        return "offload" if "cpu" in self.kv_offload and self.kv_role == "both" else "recompute"


class ListenOptions(Options):
    """Where an HTTP server of kvtier listens (`kvtier serve`, `kvtier router`)."""

    host: str = option(
        "127.0.0.1", "Address to bind. The default serves this machine only; use 0.0.0.0 to serve "
        "the network.", metavar="HOST")
    port: Annotated[int, Field(ge=0, le=65535)] = option(
        8000, "TCP port; 0 picks a free one, printed at startup.", metavar="PORT")


class ServerConfig(ListenOptions):
    """The HTTP server's options of `kvtier serve`."""

    title: ClassVar[str] = "server options"

    served_model_name: Names = option(
        (), "Model name(s) clients put in the `model` field: /v1/models lists them all, requests "
        "may use any, responses report the first (default: the MODEL value, or builtin:smollm2). "
        "Give MODEL before this flag.", metavar="NAME")
    api_key: str | None = option(
        None, "Require `Authorization: Bearer KEY` on every /v1/ request (401 otherwise); /health, "
        "/ready, /metrics and /version stay open (prefer the environment variables: command lines "
        "are visible to other users).", metavar="KEY", env=API_KEY_ENVS, secret=True)
    enable_kv_admin: bool = option(
        False, "Serve the KV admin API under /kv/ (stats, pin, unpin, flush). Requires --admin-token.")
    admin_token: str | None = option(
        None, f"Bearer token of the KV admin API, at least {MIN_ADMIN_TOKEN_CHARS} characters "
        "(prefer the environment variable: command lines are visible to other users).",
        metavar="TOKEN", env=(ADMIN_TOKEN_ENV,), secret=True)
    max_waiting_requests: Count = option(
        256, "Requests that may wait beyond the --max-num-seqs running ones; past that the server "
        "answers 503 with Retry-After.", metavar="N")
    max_prompts_per_request: PositiveCount = option(
        64, "Most prompts in one completion request; more get 400 before any is tokenized. Never "
        "more than --max-num-seqs + --max-waiting-requests: a request's prompts are admitted "
        "together or not at all.", metavar="N")
    max_request_bytes: Annotated[Size, Field(ge=1024)] = option(
        8 * 1024**2, "Largest request body (GiB, or with a unit: 8MiB); larger ones get 413.",
        metavar="SIZE")
    body_read_timeout: Seconds = option(
        30.0, "A request body must have fully arrived this long after the request head, or the "
        "server answers 408 and closes the connection.", metavar="SECONDS")
    max_body_reads_per_client: PositiveCount = option(
        16, "Request bodies one client address may be sending at once; one more gets 503 with "
        "Retry-After (bodies sent at network speed never wait, so only slow senders count).",
        metavar="N")
    retry_after: Annotated[int, Field(ge=0, le=int(MAX_SECONDS))] = option(
        1, "Retry-After of 503 answers when the queue is full.", metavar="SECONDS")
    shutdown_timeout: Annotated[float, Field(ge=0, le=MAX_SECONDS)] = option(
        30.0, "On SIGTERM, how long running requests may finish before they are aborted; SIGINT "
        "(Ctrl-C) aborts them at once. Either way each open stream ends with a last chunk whose "
        "finish_reason is \"abort\", then [DONE].",
        metavar="SECONDS")
    ready_requires_tiers: Tiers | None = option(
        None, "Offload tiers that must answer for /ready to be 200 (comma-separated, or none). "
        "Default: the local ones (cpu, disk). A remote tier (redis) that is down is reported in "
        "the body but does not fail readiness unless named here: every instance sharing it still "
        "serves (recomputing what it held), and failing them all would turn a cache outage into "
        "a full outage.", metavar="TIERS")
    tool_call_parser: Literal["hermes", "llama3_json"] = option(
        "hermes", "How tool calls are written in the model's output (vLLM's names): hermes, "
        "<tool_call>{...}</tool_call> blocks (Qwen2.5, Hermes, ChatML models, and the default "
        "rendering for templates that take no tools); llama3_json, {\"name\": ..., \"parameters\": ...} "
        "(Llama 3.x).")
    enable_auto_tool_choice: bool = option(
        True, "Serve tool_choice \"auto\" (the default when a request gives tools): the model "
        "decides and its calls are parsed with --tool-call-parser. With --no-enable-auto-tool-choice "
        "only \"none\", \"required\" and named choices are served, as vLLM without the flag.")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = option(
        "info", "Server log level.")

    def check(self) -> None:
        if self.enable_kv_admin and not self.admin_token:
            raise ConfigError(
                "admin_token",
                f"--enable-kv-admin needs a token (--admin-token or ${ADMIN_TOKEN_ENV}): "
                "the KV admin API is never served unauthenticated",
            )
        if self.enable_kv_admin and len(self.admin_token) < MIN_ADMIN_TOKEN_CHARS:
            raise ConfigError("admin_token", f"must be at least {MIN_ADMIN_TOKEN_CHARS} characters")

    def queue_size(self, max_num_seqs: int) -> int:
        """Requests admitted at once: the running ones plus the waiting ones."""
        return max_num_seqs + self.max_waiting_requests

    def prompt_limit(self, max_num_seqs: int) -> int:
        """Most prompts in one completion: the flag, never more than the queue holds."""
        return min(self.max_prompts_per_request, self.queue_size(max_num_seqs))


def read_secret_file(path: str) -> str:
    """The secret in `path` (`~` and variables expanded): its text without the trailing newline."""
    path = expand_path(path)
    try:
        secret = Path(path).read_text(encoding="utf-8").rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError("kv_secret_file", f"cannot read {path}: {exc}") from None
    if not secret:
        raise ConfigError("kv_secret_file", f"{path} holds no secret")
    return secret


# A --chat-template value with any of these characters is a template, else a file path.
JINJA_CHARS = "{}\n"


def load_chat_template(value: str) -> str:
    """The template `--chat-template` names: the text of a file, or the value itself
    when it looks like a Jinja template (as vLLM decides)."""
    try:
        return Path(expand_path(value)).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # a template is rarely a valid name (too long, a NUL)
        if any(c in value for c in JINJA_CHARS):
            return value
        if isinstance(exc, FileNotFoundError):
            raise ConfigError("chat_template", f"{value!r} is neither a file nor a Jinja template") from None
        raise ConfigError("chat_template", f"cannot read {value}: {exc}") from None


BUILTIN_PREFIX = "builtin:"


def missing_model_message(path: str) -> str:
    """Why `path` (a --model or --tokenizer that does not exist) is refused: checked with
    the other options, before any model code is imported."""
    hub_like = "/" in path and not path.startswith((".", "/", "~"))
    hint = " (a model hub id? this machine cannot download from a hub)" if hub_like else ""
    return f"{path}: no such local directory or GGUF file{hint}"


# ---- what the host can hold ---------------------------------------------------------------


def available_memory() -> int | None:
    """Bytes this process may still take: the kernel's MemAvailable, and below it what
    the cgroup's limit leaves (a container sees the host's MemAvailable). None where
    neither can be read."""
    limits = []
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            limits.append(max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return min(limits) if limits else None


def disk_room(directory: str) -> int:
    """Bytes a disk tier at `directory` may hold: the file system's free space plus the
    records the directory holds already (a restart keeps them; they count against the
    budget, not against the free space)."""
    existing = Path(directory)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    stat = os.statvfs(existing)
    held = sum(entry.stat().st_size for entry in Path(directory).rglob("*") if entry.is_file()) \
        if Path(directory).is_dir() else 0
    return stat.f_bavail * stat.f_frsize + held


def host_memory() -> int:
    """Bytes of memory this process's host (or its cgroup, if smaller) has in all."""
    with open("/proc/meminfo") as meminfo:
        total = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
    except OSError:
        return total
    return min(total, int(limit)) if limit.isdigit() else total


def resident_memory() -> int | None:
    """This process's resident memory (Linux), else None."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _worker_urls(urls: tuple[str, ...]) -> tuple[str, ...]:
    for url in urls:
        if not re.fullmatch(r"https?://[^/\s]+/?", url):
            raise ValueError(f"{url!r} is not an instance's base URL such as http://127.0.0.1:8001")
    return tuple(url.rstrip("/") for url in urls)


class RouterConfig(ListenOptions):
    """The options of `kvtier router`, an OpenAI-compatible front over several instances."""

    title: ClassVar[str] = "router options"

    worker_urls: Annotated[Names, AfterValidator(_worker_urls)] = option(
        (), "Base URLs of the `kvtier serve` instances to route to (http://host:port ...).", metavar="URL")
    policy: Literal["kv", "round-robin", "least-load", "session"] = option(
        "kv", "How an instance is chosen: kv, the lowest expected cost (the prefill left to do once "
        "what the instance holds on its device and can load from its tiers or the shared store is "
        "counted, plus its load), from the instances' KV events; round-robin; least-load (fewest "
        "requests in flight); session (the same `user`, or X-Session-ID header, to the same "
        "instance).")
    health_check_interval: Seconds = option(
        2.0, "Seconds between checks of each instance's /health and /metrics; one that fails "
        "leaves the pool until it answers again.", metavar="SECONDS")
    prefill_urls: Annotated[Names, AfterValidator(_worker_urls)] = option(
        (), "Prefill/decode disaggregation, instead of --worker-urls: the instances each prompt is "
        "prefilled on first (max_tokens 1, answered once its KV is in their shared Redis or disk "
        "tier), chosen by --policy.", metavar="URL")
    decode_urls: Annotated[Names, AfterValidator(_worker_urls)] = option(
        (), "With --prefill-urls: the instances that then answer the request, loading the prompt's "
        "KV from the shared tier (what they miss they compute).", metavar="URL")

    def check(self) -> None:
        if self.prefill_urls or self.decode_urls:
            if self.worker_urls:
                raise ConfigError("worker_urls", "give it or --prefill-urls and --decode-urls, not both")
            if not self.decode_urls:
                raise ConfigError("decode_urls", "--prefill-urls needs --decode-urls too")
            if not self.prefill_urls:
                raise ConfigError("prefill_urls", "--decode-urls needs --prefill-urls too")
        elif not self.worker_urls:
            raise ConfigError("worker_urls", "give the URL of at least one `kvtier serve` instance "
                              "(or --prefill-urls and --decode-urls)")

    @property
    def all_urls(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*self.worker_urls, *self.prefill_urls, *self.decode_urls)))


def check_host_budgets(config: EngineConfig) -> None:
    """Refuse, before anything is allocated, a cpu tier larger than the memory available
    or a disk budget larger than the disk's room: `kvtier serve` faults its cpu tier in
    at start, so a tier the host cannot hold would swap or be killed, and a disk tier
    past the free space fails its writes when the disk fills. (An error rather than a
    quietly smaller tier: the size is the operator's to choose.)"""
    if "cpu" in config.kv_offload:
        available = available_memory()
        if available is not None and config.kv_offload_cpu_size > available:
            raise ConfigError("kv_offload_cpu_size", (
                f"{format_size(config.kv_offload_cpu_size)} is more than this host's available memory "
                f"({available / GiB:.1f} GiB); lower it"))
    if "disk" in config.kv_offload:
        room = disk_room(config.disk_path)
        if config.kv_offload_disk_size > room:
            raise ConfigError("kv_offload_disk_size", (
                f"{format_size(config.kv_offload_disk_size)} is more than the room at {config.disk_path} "
                f"({room / GiB:.1f} GiB: free space plus the records it holds); lower it"))


def redact_url(url: str) -> str:
    """`url` without its credentials (redis://:secret@host -> redis://***@host)."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def default_disk_path() -> str:
    return kvtier_cache_dir("kv")
