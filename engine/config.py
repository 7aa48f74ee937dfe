"""Engine options: one dataclass whose field names are the CLI flags with underscores."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields
from pathlib import Path

_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")

OFFLOAD_TIERS = ("cpu", "disk", "redis")
DTYPES = ("auto", "float32", "bfloat16", "float16")


class ConfigError(ValueError):
    """An engine option has a bad value; `option` names the flag."""

    def __init__(self, option: str, message: str) -> None:
        super().__init__(f"--{option.replace('_', '-')}: {message}")
        self.option = option


def parse_size(text: str | int, option: str = "size") -> int:
    """Parse '4GiB', '512MiB', '1.5GB' or a plain byte count into bytes."""
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(option, f"size must be >= 0, got {text}")
        return text
    match = _SIZE_RE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ConfigError(option, f"cannot parse size {text!r} (examples: 4GiB, 512MiB, 1000000)")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_offload(value: str | tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
    """Parse 'cpu,disk' into ('cpu', 'disk'), keeping the canonical tier order."""
    if value is None or value == "" or value == "none":
        return ()
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip().lower() for n in names if n.strip()]
    unknown = [n for n in names if n not in OFFLOAD_TIERS]
    if unknown:
        raise ConfigError("kv_offload", f"unknown tier {unknown[0]!r}; choose from {', '.join(OFFLOAD_TIERS)}")
    return tuple(t for t in OFFLOAD_TIERS if t in names)


def read_secret_file(path: str) -> str:
    """The secret in `path`: its text without the trailing newline."""
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
    path = Path(value).expanduser()
    if path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError("chat_template", f"cannot read {value}: {exc}") from None
    if any(c in value for c in JINJA_CHARS):
        return value
    raise ConfigError("chat_template", f"{value!r} is neither a file nor a Jinja template")


def redact_url(url: str) -> str:
    """`url` without its credentials (redis://:secret@host -> redis://***@host)."""
    return re.sub(r"//[^@/]*@", "//***@", url)


def default_disk_path() -> str:
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache_home, "kvtier", "kv")


@dataclass
class EngineConfig:
    """Every engine option. `model=None` means the built-in default (builtin:smollm2)."""

    model: str | None = None
    tokenizer: str | None = None
    chat_template: str | None = None  # a file is read into the template text at construction
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    preemption_mode: str | None = None
    attention_backend: str = "auto"
    kv_offload: tuple[str, ...] = ()
    kv_offload_cpu_size: int = 4 * 1024**3
    kv_offload_disk_path: str | None = None
    kv_offload_disk_size: int = 32 * 1024**3
    kv_redis_url: str | None = None
    kv_chunk_tokens: int = 256
    kv_compress: str | None = None
    kv_secret: str | None = field(default=None, repr=False)
    kv_secret_file: str | None = None  # read into kv_secret at construction, then None
    kv_save_decode: bool = False
    kv_load_timeout: float = 10.0
    max_logprobs: int = 20

    def __post_init__(self) -> None:
        self.kv_offload = parse_offload(self.kv_offload)
        self.kv_offload_cpu_size = parse_size(self.kv_offload_cpu_size, "kv_offload_cpu_size")
        self.kv_offload_disk_size = parse_size(self.kv_offload_disk_size, "kv_offload_disk_size")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "kv_cache_memory")
        if self.chat_template is not None:
            self.chat_template = load_chat_template(self.chat_template)
        if self.kv_secret_file is not None:
            if self.kv_secret:
                raise ConfigError("kv_secret_file", "give --kv-secret or --kv-secret-file, not both")
            self.kv_secret, self.kv_secret_file = read_secret_file(self.kv_secret_file), None
        self.validate()

    def validate(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"{self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ConfigError("device", f"{self.device!r} is not auto, cpu or cuda[:N]")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size", f"must be a positive power of two, got {self.block_size}")
        for name in ("num_kv_blocks", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(name, f"must be positive, got {value}")
        for name in ("max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ConfigError(name, f"must be positive, got {getattr(self, name)}")
        if self.preemption_mode not in (None, "offload", "recompute"):
            raise ConfigError("preemption_mode", f"{self.preemption_mode!r} is not offload or recompute")
        if self.preemption_mode == "offload" and "cpu" not in self.kv_offload:
            raise ConfigError("preemption_mode", "offload needs the cpu tier (--kv-offload cpu,...)")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ConfigError("attention_backend", f"{self.attention_backend!r} is not auto, torch or triton")
        if self.kv_chunk_tokens <= 0 or self.kv_chunk_tokens % self.block_size:
            raise ConfigError(
                "kv_chunk_tokens",
                f"must be a positive multiple of --block-size ({self.block_size}), got {self.kv_chunk_tokens}",
            )
        if self.kv_compress not in (None, "none", "lz4"):
            raise ConfigError("kv_compress", f"{self.kv_compress!r} is not lz4 or none")
        if "redis" in self.kv_offload and not self.kv_redis_url:
            raise ConfigError("kv_redis_url", "the redis tier needs --kv-redis-url redis://host:port")
        if self.max_logprobs < 0:
            raise ConfigError("max_logprobs", f"must be >= 0, got {self.max_logprobs}")
        if self.kv_load_timeout <= 0:
            raise ConfigError("kv_load_timeout", f"must be positive, got {self.kv_load_timeout}")

    @property
    def effective_preemption_mode(self) -> str:
        if self.preemption_mode:
            return self.preemption_mode
        return "offload" if "cpu" in self.kv_offload else "recompute"

    @property
    def disk_path(self) -> str:
        return self.kv_offload_disk_path or default_disk_path()

    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs) -> EngineConfig:
        """Build from LLM(...) keyword arguments; an unknown name is a ConfigError."""
        known = set(cls.option_names())
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(unknown[0], "is not an engine option")
        return cls(model=model, **kwargs)
