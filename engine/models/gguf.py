"""GGUF checkpoints: the model config from the file's metadata, dequantized weights under
Hugging Face names, and the tokenizer with its chat template from the same file.

A GGUF file is what llama.cpp runs; it holds everything a Hugging Face directory holds,
under llama.cpp's names. Weights are read with the `gguf` library and dequantized to the
requested dtype. Two llama.cpp conventions are undone here: Llama-architecture files
store the rows of the Q and K projections interleaved for llama.cpp's rope layout
(undone by `_unpermute_rope_rows`), and a missing `output.weight` means the embedding is
tied. The tokenizer is built by transformers' own GGUF support, so a file tokenizes
here exactly as it does in transformers.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NoReturn

import numpy as np
import torch

from engine.models.args import ModelLoadError, UnsupportedArchitectureError

# general.architecture -> (architecture name as in config.json, model_type)
# (llama.cpp's converter writes Mistral models as "llama": the same computation)
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
# llama.cpp interleaves Q/K rows for its rope layout in these architectures only
PERMUTED_ROPE_ARCHITECTURES = ("llama",)

# the tensor types the gguf library dequantizes and that we have tested
SUPPORTED_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)
FLOAT_TYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

# GGUF tensor name pieces -> Hugging Face module names
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# tensors that carry nothing the forward pass uses
_IGNORED_TENSORS = ("rope_freqs",)

# Bounds of the integer metadata (under the architecture's prefix), checked before any of
# it sizes an allocation: a hostile file must not make the model builder ask for 10^9
# layers or a rope table of 2^40 positions. Several times what any supported model uses
# (Llama 3.1 405B: 126 layers, hidden 16384, ffn 53248; Qwen2.5-1M: 1,010,000 positions;
# vocabularies up to 256k); the rope table of the largest context is 2^20 rows.
INT_LIMITS = {
    "block_count": 1024,
    "context_length": 1 << 20,
    "embedding_length": 1 << 16,
    "feed_forward_length": 1 << 20,
    "attention.head_count": 1024,
    "attention.head_count_kv": 1024,
    "attention.key_length": 1024,
    "attention.value_length": 1024,
    "rope.dimension_count": 1024,
    "rope.scaling.original_context_length": 1 << 20,
    "attention.sliding_window": 1 << 20,
    "vocab_size": 1 << 22,
}
MAX_ROPE_SCALING_FACTOR = 1024.0
# shapes (numpy order) of the tensors, per GGUF tensor kind, in the dimensions below
_TENSOR_SHAPES = {
    "token_embd.weight": ("vocab", "hidden"),
    "output.weight": ("vocab", "hidden"),
    "output_norm.weight": ("hidden",),
    "attn_norm.weight": ("hidden",),
    "ffn_norm.weight": ("hidden",),
    "attn_q.weight": ("q", "hidden"),
    "attn_q.bias": ("q",),
    "attn_k.weight": ("kv", "hidden"),
    "attn_k.bias": ("kv",),
    "attn_v.weight": ("kv", "hidden"),
    "attn_v.bias": ("kv",),
    "attn_output.weight": ("hidden", "q"),
    "attn_output.bias": ("hidden",),
    "attn_q_norm.weight": ("head_dim",),
    "attn_k_norm.weight": ("head_dim",),
    "ffn_gate.weight": ("ffn", "hidden"),
    "ffn_up.weight": ("ffn", "hidden"),
    "ffn_down.weight": ("hidden", "ffn"),
}
# the metadata fields each dimension is the product of (the first is what a shape
# mismatch names), and the config key that holds that first field's value
_DIMENSION_FIELDS = {
    "vocab": (("vocab_size",), "vocab_size"),
    "hidden": (("embedding_length",), "hidden_size"),
    "q": (("attention.head_count", "attention.key_length"), "num_attention_heads"),
    "kv": (("attention.head_count_kv", "attention.key_length"), "num_key_value_heads"),
    "head_dim": (("attention.key_length",), "head_dim"),
    "ffn": (("feed_forward_length",), "intermediate_size"),
}


class UnsupportedTensorTypeError(UnsupportedArchitectureError):
    """A GGUF tensor is stored in a type this loader does not dequantize."""


class GGUFMetadataError(ModelLoadError):
    """A GGUF metadata field is missing, of the wrong type, out of bounds, or disagrees
    with the tensors. One line naming the file and the field (the CLI prints it as is),
    raised before anything is allocated from the metadata."""

    def __init__(self, path: str, field: str, value: Any, problem: str) -> None:
        self.field = field
        shown = "missing" if value is None else f"= {_short(value)}"
        super().__init__(f"{path}: GGUF metadata {field} {shown}: {problem}")


def _short(value: Any, limit: int = 60) -> str:
    """`value` for a one-line message: its repr (newlines escaped), cut at `limit`."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class GGUFTensor:
    hf_name: str
    type_name: str
    data: np.ndarray  # as stored: raw blocks (uint8) for quantized types
    ggml_type: Any


class GGUFCheckpoint:
    """One GGUF file, opened lazily: metadata, config, tensors."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        try:
            from gguf import GGUFReader
        except ImportError as exc:  # declared a dependency; a broken install says so
            raise ModelLoadError("reading GGUF files needs the `gguf` package (pip install gguf)") from exc
        try:
            self._reader = GGUFReader(self.path)
        except (ValueError, OSError, IndexError) as exc:
            raise ModelLoadError(f"{self.path}: not a readable GGUF file ({exc})") from exc

    # ---- metadata -------------------------------------------------------------------------

    def field(self, key: str, default: Any = None) -> Any:
        entry = self._reader.fields.get(key)
        if entry is None:
            return default
        return entry.contents()

    @cached_property
    def gguf_architecture(self) -> str:
        arch = self.field("general.architecture")
        if arch not in GGUF_ARCHITECTURES:
            supported = ", ".join(sorted(GGUF_ARCHITECTURES))
            raise UnsupportedArchitectureError(
                f"{self.path}: unsupported GGUF architecture {arch!r}; supported: {supported}"
            )
        return arch

    def _arch_field(self, name: str) -> Any:
        return self.field(f"{self.gguf_architecture}.{name}")

    @cached_property
    def config(self) -> dict[str, Any]:
        """A Hugging Face config dict (config.json fields) equivalent to the metadata.

        Every field is checked (type, bounds, agreement with the tensor shapes and with
        the other fields) here, before the model is built from it: a hostile or broken
        file is a `GGUFMetadataError` naming the field, never an allocation sized by it.
        """
        arch = self.gguf_architecture
        architecture, model_type = GGUF_ARCHITECTURES[arch]
        hidden = self._int("embedding_length")
        heads = self._int("attention.head_count")
        kv_heads = self._int("attention.head_count_kv", heads)
        if heads % kv_heads:
            self._fail("attention.head_count_kv", kv_heads, f"does not divide attention.head_count ({heads})")
        head_dim = self._int("attention.key_length", None)
        if head_dim is None:
            if hidden % heads:
                self._fail("attention.head_count", heads, f"does not divide embedding_length ({hidden})")
            head_dim = hidden // heads
        if head_dim % 2:
            self._fail("attention.key_length", head_dim, "must be even (rotary embeddings rotate halves)")
        for name in ("attention.value_length", "rope.dimension_count"):
            if self._int(name, head_dim) != head_dim:
                self._fail(name, self._arch_field(name), f"differs from the head dim ({head_dim}), "
                           "which is not supported")
        context = self._int("context_length")
        names = self.tensor_names
        vocab = self._vocab_size()
        config: dict[str, Any] = {
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": self._int("feed_forward_length"),
            "num_hidden_layers": self._int("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "rms_norm_eps": self._float("attention.layer_norm_rms_epsilon", None, 0.0, 1.0),
            "max_position_embeddings": context,
            "vocab_size": vocab,
            "rope_theta": self._float("rope.freq_base", 10000.0, 1.0),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
            "attention_bias": arch != "qwen2" and "blk.0.attn_output.bias" in names,
            "bos_token_id": self._token_id("tokenizer.ggml.bos_token_id", vocab),
            "eos_token_id": self._token_id("tokenizer.ggml.eos_token_id", vocab),
            "dtype": self.default_dtype,
        }
        rope_scaling = self._rope_scaling()
        if rope_scaling:
            config["rope_scaling"] = rope_scaling
        window = self._int("attention.sliding_window", None, low=0)  # 0: none
        if window:
            config["sliding_window"] = window
            config["use_sliding_window"] = True
        if "rope_freqs.weight" in names:
            raise UnsupportedArchitectureError(
                f"{self.path}: precomputed rope frequency factors (rope_freqs.weight, as in "
                "Llama 3.1 GGUF files) are not supported"
            )
        self._check_tensors(config)
        return config

    def _fail(self, name: str, value: Any, problem: str) -> NoReturn:
        raise GGUFMetadataError(self.path, f"{self.gguf_architecture}.{name}", value, problem)

    def _int(self, name: str, default: Any = ..., low: int = 1) -> Any:
        """The integer field `name` (under the architecture's prefix), in [low,
        INT_LIMITS[name]]; `default` when absent (required when no default is given)."""
        value = self._arch_field(name)
        if value is None:
            if default is ...:
                self._fail(name, None, "required")
            return default
        if not isinstance(value, int) or isinstance(value, bool):
            self._fail(name, value, "must be an integer")
        if not low <= value <= INT_LIMITS[name]:
            self._fail(name, value, f"must be in [{low}, {INT_LIMITS[name]}]")
        return value

    def _float(self, name: str, default: float | None, low: float, high: float = math.inf) -> float:
        """The finite number field `name`, with low < value <= high; `default` when
        absent (required when it is None)."""
        value = self._arch_field(name)
        if value is None:
            if default is None:
                self._fail(name, None, "required")
            return default
        if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
            self._fail(name, value, "must be a finite number")
        if not low < value <= high:
            self._fail(name, value, f"must be above {low}" + (f" and at most {high}" if high < math.inf else ""))
        return float(value)

    def _token_id(self, key: str, vocab: int) -> int | None:
        value = self.field(key)
        if value is not None and (not isinstance(value, int) or not 0 <= value < vocab):
            raise GGUFMetadataError(self.path, key, value, f"must be a token id in [0, {vocab})")
        return value

    def _vocab_size(self) -> int:
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        size = self._int("vocab_size", None)
        if size is None:
            if tokens is None:
                raise ModelLoadError(f"{self.path}: GGUF metadata has neither vocab_size nor tokens")
            size = len(tokens.data)
            if not 1 <= size <= INT_LIMITS["vocab_size"]:
                raise GGUFMetadataError(self.path, "tokenizer.ggml.tokens", f"{size} tokens",
                                        f"must be 1 to {INT_LIMITS['vocab_size']} tokens")
        elif tokens is not None and len(tokens.data) > size:
            self._fail("vocab_size", size, f"is smaller than the tokenizer's {len(tokens.data)} tokens "
                       "(tokenizer.ggml.tokens)")
        return size

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind not in ("linear", "yarn"):
            self._fail("rope.scaling.type", kind, "not supported (supported: none, linear, yarn)")
        factor = self._float("rope.scaling.factor", None, 0.0, MAX_ROPE_SCALING_FACTOR)
        scaling: dict[str, Any] = {"rope_type": kind, "factor": factor}
        original = self._int("rope.scaling.original_context_length", None)
        if original:
            scaling["original_max_position_embeddings"] = original
        return scaling

    def _check_tensors(self, config: dict[str, Any]) -> None:
        """Each tensor's shape against the metadata, and the layers the tensors hold
        against block_count, so that the metadata that sizes the model is the file's."""
        head_dim = config["head_dim"]
        dims = {
            "vocab": config["vocab_size"], "hidden": config["hidden_size"], "head_dim": head_dim,
            "q": config["num_attention_heads"] * head_dim, "kv": config["num_key_value_heads"] * head_dim,
            "ffn": config["intermediate_size"],
        }
        layers: set[str] = set()
        for tensor in self._reader.tensors:
            parts = tensor.name.split(".")
            kind = tensor.name
            if parts[0] == "blk" and len(parts) == 4:
                layers.add(parts[1])
                kind = f"{parts[2]}.{parts[3]}"
            expected = _TENSOR_SHAPES.get(kind)
            if expected is None:
                continue  # not ours: tensors() names it
            shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dims innermost first
            want = tuple(dims[d] for d in expected)
            if shape != want:
                wrong = next((d for d, n in zip(expected, shape, strict=False) if dims[d] != n), expected[0])
                fields, key = _DIMENSION_FIELDS[wrong]
                product = " x ".join(f"{self.gguf_architecture}.{f}" for f in fields)
                self._fail(fields[0], config[key], f"disagrees with tensor {tensor.name}: its shape is "
                           f"{shape}, where the metadata ({product}) makes it {want}")
        count = config["num_hidden_layers"]
        if layers != {str(i) for i in range(count)}:
            self._fail("block_count", count, f"the file holds tensors of {len(layers)} layers "
                       f"({_short(sorted(layers, key=lambda n: (len(n), n)))})")

    @cached_property
    def default_dtype(self) -> str:
        """What `--dtype auto` means for this file: the float type of its weights when
        they are all F32, F16 or BF16, else (quantized files) bfloat16, which keeps
        fp32's range at half the memory."""
        types = {t.tensor_type.name for t in self._reader.tensors if len(t.shape) > 1}
        if len(types) == 1 and (only := next(iter(types))) in FLOAT_TYPES:
            return FLOAT_TYPES[only]
        return "bfloat16"

    @cached_property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self._reader.tensors)

    # ---- tensors --------------------------------------------------------------------------

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every tensor the forward pass uses, under its Hugging Face name, as stored."""
        for tensor in self._reader.tensors:
            hf_name = hf_tensor_name(tensor.name)
            if hf_name is None:
                if tensor.name.split(".")[0] in _IGNORED_TENSORS:
                    continue
                raise ModelLoadError(f"{self.path}: unexpected GGUF tensor {tensor.name!r}")
            type_name = tensor.tensor_type.name
            if type_name not in SUPPORTED_TENSOR_TYPES:
                raise UnsupportedTensorTypeError(
                    f"{self.path}: tensor {tensor.name} has type {type_name}, which is not "
                    f"supported; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
                )
            yield GGUFTensor(hf_name, type_name, tensor.data, tensor.tensor_type)

    def dequantized(self, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, tensor in `dtype`) for every weight, in Hugging Face layout."""
        from gguf.quants import dequantize

        config = self.config
        permuted = self.gguf_architecture in PERMUTED_ROPE_ARCHITECTURES
        for tensor in self.tensors():
            values = torch.from_numpy(np.require(dequantize(tensor.data, tensor.ggml_type), requirements=("C", "W")))
            if permuted and tensor.hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                is_q = tensor.hf_name.endswith("q_proj.weight")
                heads = config["num_attention_heads"] if is_q else config["num_key_value_heads"]
                values = _unpermute_rope_rows(values, heads)
            yield tensor.hf_name, values.to(dtype)


def hf_tensor_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if unknown."""
    parts = gguf_name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[parts[0]]}.{parts[1]}"
    return None


def _unpermute_rope_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order. Its converter writes, per head, the rows of the
    two rotary halves interleaved (row pairs (i, i + d/2) side by side); Hugging Face's
    rotate-half layout keeps each half contiguous."""
    rows = weight.shape[0]
    half = rows // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def load_gguf_tokenizer(path: str) -> Any:
    """The file's tokenizer (with chat template) through transformers' GGUF support."""
    from transformers import AutoTokenizer

    directory, name = os.path.split(os.path.abspath(path))
    try:
        return AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, OSError) as exc:
        raise ModelLoadError(f"{path}: cannot build the tokenizer from the GGUF metadata ({exc})") from exc
