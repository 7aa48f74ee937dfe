"""Model hyperparameters read from a Hugging Face config, and the architecture registry.

One decoder implementation serves every supported family; what differs between them is
captured by the flags of `ModelArgs` (biases, per-head q/k norm, tied embeddings).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture (or one of its features) has no implementation here."""


class ModelLoadError(RuntimeError):
    """The checkpoint directory is incomplete or inconsistent with its config."""


# architecture name in config.json -> model_type it belongs to
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True)
class ModelArgs:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_parameters: dict[str, Any] = field(hash=False)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def digest(self) -> str:
        """SHA-256 hex of these hyperparameters in a canonical form.

        They are everything the forward pass reads from a config (rope theta and scaling,
        norm epsilon, head layout, ...), so two checkpoints whose configs parse to equal
        args compute the same KV from the same weights: this digest goes into the model
        fingerprint (a store must not serve KV computed under another config). Built from
        the parsed args, not config.json's bytes, so a GGUF file and a Hugging Face
        directory both have one and formatting does not matter; numbers are compared as
        floats, so `rope_theta: 10000` and `10000.0` agree.
        """
        canonical = json.dumps(_canonical(asdict(self)), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _canonical(value: Any) -> Any:
    """`value` with every number as a float (bools kept), so equal numbers encode alike."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def architecture_of(config: Any) -> tuple[str, str]:
    """(architecture, model_type) of a transformers config; raises if unsupported."""
    names = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name, SUPPORTED_ARCHITECTURES[name]
    if not names:
        for name, family in SUPPORTED_ARCHITECTURES.items():
            if family == model_type:
                return name, family
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
    found = ", ".join(names) or f"model_type={model_type!r}"
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {found}; supported: {supported}"
    )


def args_from_config(config: Any) -> ModelArgs:
    """Translate a transformers `PretrainedConfig` into `ModelArgs`."""
    architecture, model_type = architecture_of(config)
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitectureError(f"hidden_act {act!r} is not supported (only 'silu')")
    num_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    return ModelArgs(
        architecture=architecture,
        model_type=model_type,
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=rope_parameters_of(config),
        qkv_bias=attention_bias or model_type == "qwen2",
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(getattr(config, "mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        sliding_window=_sliding_window(config, model_type),
    )


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The rope dict in transformers' standardized form (`rope_type`, `rope_theta`, ...)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if set(params) & {"full_attention", "sliding_attention"}:
        raise UnsupportedArchitectureError("per-layer-type rope parameters are not supported")
    legacy = getattr(config, "rope_scaling", None) or {}
    for key, value in legacy.items():
        params.setdefault(key, value)
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


def _sliding_window(config: Any, model_type: str) -> int | None:
    """The attention window if the config really enables one (Qwen configs carry a
    `sliding_window` value even when `use_sliding_window` is false)."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    if model_type in ("qwen2", "qwen3") and not getattr(config, "use_sliding_window", False):
        return None
    return int(window)
