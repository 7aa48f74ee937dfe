"""Write tiny GGUF files for the GGUF loader tests, the way llama.cpp's converter does.

`write_gguf` takes a Hugging Face checkpoint directory (a tiny random model) and writes
its weights in one chosen tensor type, the Llama-family metadata, and the byte-level BPE
tokenizer with its chat template. Llama files get llama.cpp's Q/K row permutation.

The gguf library quantizes F32, F16, BF16, Q8_0, Q4_0 and Q4_1 itself; for the K-quants
(Q4_K, Q5_K, Q6_K), which it can only dequantize, each tensor is written as random
blocks whose fp16 scales are set so that the dequantized weights have the random
models' spread. Either way the file is a valid GGUF whose dequantized weights are the
ground truth both our loader and transformers must read.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.gguf_writer import GGUFValue
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file
from transformers import AutoTokenizer

QUANTIZABLE = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}
# K-quant block layouts: bytes per block of 256 values, and the byte offsets of the
# fp16 super-block scale `d` and (when the type has one) the minimum `dmin`
K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}
TARGET_STD = 0.1  # the spread of the random models' weights (engine/random_model.py)

_GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(
    checkpoint: str, out_path: str, tensor_type: str = "F32", architecture: str | None = None,
    seed: int = 0, metadata: Mapping[str, Any] | None = None,
) -> str:
    """Write `checkpoint` as a GGUF file at `out_path`; matrices in `tensor_type`, norms
    and biases in F32 (as llama.cpp does). `architecture` overrides the GGUF
    architecture name (Mistral is written as "llama", as llama.cpp does). `metadata`
    edits the metadata as a hostile file would (`edit_metadata`)."""
    with open(os.path.join(checkpoint, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    arch = architecture or {"mistral": "llama"}.get(config["model_type"], config["model_type"])
    writer = GGUFWriter(out_path, arch)
    _write_metadata(writer, arch, config)
    _write_tokenizer(writer, checkpoint)
    edit_metadata(writer, metadata or {})
    rng = np.random.default_rng(seed)
    weights = load_file(os.path.join(checkpoint, "model.safetensors"))
    for name, tensor in weights.items():
        gguf_name = _gguf_name(name)
        values = tensor.to(torch.float32).numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            values = _permute_rope_rows(values, heads)
        kind = tensor_type if values.ndim == 2 else "F32"
        _add_tensor(writer, gguf_name, values, kind, rng)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


def _write_metadata(writer: GGUFWriter, arch: str, config: dict) -> None:
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or config["rope_parameters"]["rope_theta"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(0)


def edit_metadata(writer: GGUFWriter, changes: Mapping[str, Any]) -> None:
    """Apply `changes` (key -> value) to the metadata about to be written: None leaves the
    key out, a `GGUFValue` is written as given (any type), another value keeps the key's
    type (a new key: a string, an unsigned 32-bit integer or a float32)."""
    kv_data = writer.kv_data[0]
    for key, value in changes.items():
        if value is None:
            kv_data.pop(key, None)
        elif isinstance(value, GGUFValue):
            kv_data[key] = value
        elif key in kv_data:
            kv_data[key] = GGUFValue(value, kv_data[key].type, kv_data[key].sub_type)
        else:
            kind = {str: GGUFValueType.STRING, int: GGUFValueType.UINT32}.get(type(value), GGUFValueType.FLOAT32)
            kv_data[key] = GGUFValue(value, kind)


def _write_tokenizer(writer: GGUFWriter, checkpoint: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in special else 1 for t in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id)
    writer.add_chat_template(tokenizer.chat_template)


def _gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, param = rest.rsplit(".", 1)
    return f"blk.{layer}.{_GGUF_NAMES[module]}.{param}"


def _permute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: per head, interleave the rows of the two rotary halves."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, kind: str, rng: np.random.Generator) -> None:
    qtype = GGMLQuantizationType[kind]
    if kind == "F32":
        writer.add_tensor(name, values.astype(np.float32))
    elif kind == "F16":
        writer.add_tensor(name, values.astype(np.float16))
    elif kind in QUANTIZABLE:
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)
    elif kind in K_QUANT_SCALES:
        writer.add_tensor(name, _random_k_blocks(values.shape, kind, rng), raw_dtype=qtype)
    else:  # a type the loader must refuse: any bytes of the right size
        block_values, block_bytes = GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (values.shape[0], values.shape[1] // block_values * block_bytes))
        writer.add_tensor(name, raw.astype(np.uint8), raw_dtype=qtype)


def _random_k_blocks(shape: tuple[int, ...], kind: str, rng: np.random.Generator) -> np.ndarray:
    """Random K-quant blocks for a tensor of `shape` whose dequantized values have mean 0
    and a standard deviation of TARGET_STD.

    A K-quant value is `d * scale * q - dmin * min` (Q6_K: no minimum, q signed), linear
    in the block's fp16 `d` and `dmin`, so the dequantized values with d=1, dmin=0 and
    with d=0, dmin=1 tell which `d` and `dmin` give that mean and spread."""
    qtype = GGMLQuantizationType[kind]
    rows, cols = shape
    if cols % 256:
        raise ValueError(f"{kind} needs rows of a multiple of 256 values, got {cols}")
    block_bytes = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[kind]
    blocks = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    d_at, dmin_at = K_QUANT_SCALES[kind]

    def values(d: float, dmin: float) -> np.ndarray:
        _set_half(blocks, d_at, d)
        if dmin_at is not None:
            _set_half(blocks, dmin_at, dmin)
        return dequantize(blocks.reshape(rows, -1), qtype)

    scaled = values(1.0, 0.0)
    dmin = float(scaled.mean() / -values(0.0, 1.0).mean()) if dmin_at is not None else 0.0
    spread = float(values(1.0, dmin).std())
    values(TARGET_STD / spread, dmin * TARGET_STD / spread)
    return blocks.reshape(rows, -1)


def _set_half(blocks: np.ndarray, offset: int, value: float) -> None:
    blocks[..., offset : offset + 2] = np.frombuffer(np.float16(value).tobytes(), dtype=np.uint8)
