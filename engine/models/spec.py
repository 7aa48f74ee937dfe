"""`ModelSpec` (what the engine needs to know about a loaded model) and dtype resolution."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # e.g. "LlamaForCausalLM"
    model_type: str  # e.g. "llama"
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    bos_token_id: int | None
    torch_dtype: str | None  # the checkpoint's dtype as its config names it
    weights_digest: str  # xxh3-128 hex over the safetensors files (or the GGUF file)
    config_digest: str  # ModelArgs.digest: the parsed hyperparameters the KV depends on


def resolve_dtype(
    name: str | torch.dtype, spec_or_config: Any = None, device: torch.device | str | None = None
) -> torch.dtype:
    """The torch dtype for `--dtype NAME`.

    "auto" takes the dtype the checkpoint's config declares and falls back to float32 when
    it declares none. On a CPU `device` a declared bfloat16 or float16 becomes float32
    where the CPU has no native matmul for it (no AVX512-BF16/AMX, say): there oneDNN
    emulates the half dtype, a prefill's matmuls run about 10x slower than in float32,
    and decode is slower too. `spec_or_config` may be a `ModelSpec`, a transformers
    config, a config dict, or a checkpoint directory.
    """
    if isinstance(name, torch.dtype):
        return name
    key = name.lower().removeprefix("torch.")
    if key != "auto":
        if key not in DTYPES:
            raise ValueError(f"unknown dtype {name!r}; expected auto or one of {', '.join(DTYPES)}")
        return DTYPES[key]
    declared = config_dtype_name(spec_or_config)
    dtype = DTYPES.get(declared, torch.float32) if declared else torch.float32
    if device is not None and torch.device(device).type == "cpu" and not cpu_has_native_matmul(dtype):
        return torch.float32
    return dtype


def cpu_has_native_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU runs `dtype` matmuls natively (oneDNN's own probe; float32 always)."""
    if dtype == torch.bfloat16:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if dtype == torch.float16:
        return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


def config_dtype_name(source: Any) -> str | None:
    """The dtype a spec / config / config dict / checkpoint directory declares, as a name."""
    if source is None:
        return None
    if isinstance(source, ModelSpec):
        value = source.torch_dtype
    elif isinstance(source, str | os.PathLike):
        value = config_dtype_name(read_json(os.path.join(source, "config.json")))
    elif isinstance(source, Mapping):
        value = source.get("dtype") or source.get("torch_dtype")
    else:
        value = getattr(source, "dtype", None) or getattr(source, "torch_dtype", None)
    return str(value).removeprefix("torch.") if value else None


def eos_token_ids(config: Any, generation_config: Mapping[str, Any]) -> list[int]:
    """EOS ids from generation_config.json first, then config.json, without duplicates."""
    ids: list[int] = []
    for value in (generation_config.get("eos_token_id"), getattr(config, "eos_token_id", None)):
        for token in value if isinstance(value, list) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids


def read_json(path: str) -> dict[str, Any]:
    """A JSON file as a dict, or {} if it does not exist."""
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)
