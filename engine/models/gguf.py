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

import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import torch

from engine.models.args import ModelLoadError, UnsupportedArchitectureError

GGUF_SUFFIX = ".gguf"

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


class UnsupportedTensorTypeError(UnsupportedArchitectureError):
    """A GGUF tensor is stored in a type this loader does not dequantize."""


def is_gguf(path: str | os.PathLike[str]) -> bool:
    return os.fspath(path).lower().endswith(GGUF_SUFFIX) and os.path.isfile(path)


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

    def _arch_field(self, name: str, default: Any = None) -> Any:
        return self.field(f"{self.gguf_architecture}.{name}", default)

    @cached_property
    def config(self) -> dict[str, Any]:
        """A Hugging Face config dict (config.json fields) equivalent to the metadata."""
        arch = self.gguf_architecture
        architecture, model_type = GGUF_ARCHITECTURES[arch]
        hidden = self._required("embedding_length")
        heads = self._required("attention.head_count")
        head_dim = self._arch_field("attention.key_length") or hidden // heads
        names = self.tensor_names
        config: dict[str, Any] = {
            "architectures": [architecture],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": self._required("feed_forward_length"),
            "num_hidden_layers": self._required("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch_field("attention.head_count_kv") or heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(self._required("attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": self._required("context_length"),
            "vocab_size": self._vocab_size(),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in names,
            "hidden_act": "silu",
            "attention_bias": arch != "qwen2" and "blk.0.attn_output.bias" in names,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "dtype": self.default_dtype,
        }
        rope_scaling = self._rope_scaling()
        if rope_scaling:
            config["rope_scaling"] = rope_scaling
        window = self._arch_field("attention.sliding_window")
        if window:
            config["sliding_window"] = int(window)
            config["use_sliding_window"] = True
        if "rope_freqs.weight" in names:
            raise UnsupportedArchitectureError(
                f"{self.path}: precomputed rope frequency factors (rope_freqs.weight, as in "
                "Llama 3.1 GGUF files) are not supported"
            )
        return config

    def _required(self, name: str) -> Any:
        value = self._arch_field(name)
        if value is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata lacks {self.gguf_architecture}.{name}")
        return value

    def _vocab_size(self) -> int:
        size = self._arch_field("vocab_size")
        if size is not None:
            return int(size)
        tokens = self._reader.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ModelLoadError(f"{self.path}: GGUF metadata has neither vocab_size nor tokens")
        return len(tokens.data)

    def _rope_scaling(self) -> dict[str, Any] | None:
        kind = self._arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind not in ("linear", "yarn"):
            raise UnsupportedArchitectureError(f"{self.path}: rope scaling {kind!r} is not supported")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(self._arch_field("rope.scaling.factor"))}
        original = self._arch_field("rope.scaling.original_context_length")
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling

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
