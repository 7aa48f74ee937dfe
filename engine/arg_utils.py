"""Engine options as command-line flags (shared by `kvtier generate`, `serve` and `bench`)."""

from __future__ import annotations

import argparse

from engine.config import DTYPES, ConfigError, EngineConfig, parse_size

_HELP = {
    "model": "Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer), a "
    ".gguf file, or builtin:NAME (see kvtier --help). Default: builtin:smollm2 "
    "(SmolLM2-135M-Instruct, installed by `kvtier download-model`).",
    "tokenizer": "Tokenizer directory, when it differs from --model.",
    "chat_template": "Chat template to use instead of the model's: a Jinja file, or the "
    "template itself (a value with braces or a newline).",
    "dtype": "Weights and KV-cache dtype; auto takes the checkpoint's declared dtype (a GGUF "
    "file: its float type, bfloat16 when quantized).",
    "device": "auto (CUDA when available), cpu, cuda or cuda:N.",
    "seed": "Seed for weight-independent randomness (sampling without a per-request seed).",
    "block_size": "Tokens per KV-cache block (power of two).",
    "num_kv_blocks": "Size the device KV pool in blocks (overrides --kv-cache-memory).",
    "kv_cache_memory": "Size the device KV pool in bytes, e.g. 2GiB. "
    "Default: 1GiB on CPU, half the free GPU memory on CUDA.",
    "max_model_len": "Longest prompt + output in tokens. Default: the model's max_position_embeddings.",
    "max_num_seqs": "Most requests running in one step.",
    "max_num_batched_tokens": "Token budget of one step (prefill chunks plus decodes).",
    "enable_prefix_caching": "Reuse KV blocks of identical prefixes on the device.",
    "preemption_mode": "What happens to a preempted request's KV: offload (to the cpu tier; "
    "the default when it exists) or recompute.",
    "attention_backend": "auto (Triton on CUDA, torch elsewhere), torch or triton.",
    "kv_offload": "Comma-separated offload tiers below the device: any of cpu, disk, redis.",
    "kv_offload_cpu_size": "Byte budget of the cpu tier, e.g. 4GiB.",
    "kv_offload_disk_path": "Directory of the disk tier (default: ~/.cache/kvtier/kv). "
    "Several instances may share it.",
    "kv_offload_disk_size": "Byte budget of the disk tier, e.g. 32GiB.",
    "kv_redis_url": "Redis tier URL: redis://host:port, rediss://:password@host:port, "
    "or redis+cluster://host:port,host:port.",
    "kv_chunk_tokens": "Tokens per stored chunk (a multiple of --block-size).",
    "kv_compress": "Compression of records below the cpu tier: lz4 or none.",
    "kv_secret": "Shared secret: records are signed with HMAC-SHA256 and unsigned or foreign ones "
    "rejected. Set it on any tier others can write to (docs/RELIABILITY.md); prefer "
    "--kv-secret-file, command lines are visible to other users.",
    "kv_secret_file": "File holding the --kv-secret (its text without the trailing newline).",
    "kv_save_decode": "Also save chunks completed during decoding, not only prompt chunks.",
    "kv_load_timeout": "Seconds to wait for a disk/redis load before recomputing instead.",
    "max_logprobs": "Most top logprobs a request may ask for (completions `logprobs`, chat "
    "`top_logprobs`); more is refused.",
}
_SIZE_OPTIONS = {"kv_cache_memory", "kv_offload_cpu_size", "kv_offload_disk_size"}
_CHOICES = {
    "dtype": DTYPES,
    "preemption_mode": ("offload", "recompute"),
    "attention_backend": ("auto", "torch", "triton"),
    "kv_compress": ("lz4", "none"),
}


def _size(option: str):
    def parse(text: str) -> int:
        try:
            return parse_size(text, option)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[-1]) from exc

    parse.__name__ = "size"
    return parse


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one flag per EngineConfig field; defaults come from EngineConfig."""
    defaults = EngineConfig.__dataclass_fields__
    group = parser.add_argument_group("engine options")
    for name in EngineConfig.option_names():
        flag = "--" + name.replace("_", "-")
        default = defaults[name].default
        help_text = _HELP[name] + (f" (default: {default})" if default not in (None, ()) else "")
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif name in _SIZE_OPTIONS:
            group.add_argument(flag, type=_size(name), default=None, help=help_text, metavar="SIZE")
        elif name in _CHOICES:
            group.add_argument(flag, choices=_CHOICES[name], default=None, help=help_text)
        elif isinstance(default, int) or name in ("num_kv_blocks", "max_model_len"):
            kind = int if name in ("seed", "max_logprobs") else _positive_int
            group.add_argument(flag, type=kind, default=None, help=help_text)
        elif isinstance(default, float):
            group.add_argument(flag, type=float, default=None, help=help_text)
        else:
            group.add_argument(flag, type=str, default=None, help=help_text)


def add_model_positional(parser: argparse.ArgumentParser) -> None:
    """`kvtier serve MODEL`, as `vllm serve MODEL`: the model as the first argument."""
    parser.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                        help="The model to serve, as --model takes it (give one of the two).")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build the EngineConfig from parsed flags (unset flags keep EngineConfig defaults)."""
    given = {
        name: getattr(args, name)
        for name in EngineConfig.option_names()
        if getattr(args, name, None) is not None
    }
    positional = getattr(args, "model_tag", None)
    if positional is not None:
        if given.get("model", positional) != positional:
            raise ConfigError(
                "model", f"the model is given twice, as MODEL {positional!r} and as --model "
                f"{given['model']!r}; give one of them"
            )
        given["model"] = positional
    if given.get("kv_compress") == "none":
        given["kv_compress"] = None
    return EngineConfig(**given)
