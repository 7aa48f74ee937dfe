"""GGUF checkpoints: weights of every supported tensor type, config and tokenizer from
the file's metadata, against transformers' own loading of the same file.

The files are tiny random models written as llama.cpp writes them (tests/engine/gguf_files.py):
Llama files with llama.cpp's Q/K row permutation, which the loader must undo. The real
model's GGUF is checked in tests/real_model.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import LLM, SamplingParams
from engine.models import UnsupportedArchitectureError, load_model
from engine.models.gguf import UnsupportedTensorTypeError
from tests.engine.gguf_files import write_gguf

# rows of 256 values: every type's block size divides them, the K-quants' included
DIMS = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64}
PROMPT = list(range(5, 45))
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_factory(tiny_model_factory, tmp_path_factory):
    """make(architecture, tensor_type, **overrides) -> path of a GGUF file (built once)."""
    directory = tmp_path_factory.mktemp("gguf")
    built: dict[tuple, str] = {}

    def make(architecture: str = "llama", tensor_type: str = "F32", **overrides) -> str:
        key = (architecture, tensor_type, tuple(sorted(overrides.items())))
        if key not in built:
            checkpoint = tiny_model_factory(architecture, **{**DIMS, **overrides})
            name = f"{architecture}-{tensor_type}-{len(built)}.gguf"
            built[key] = write_gguf(checkpoint, str(directory / name), tensor_type)
        return built[key]

    return make


def engine_tokens(path: str, prompt: list[int]) -> list[int]:
    with LLM(model=path, dtype="float32", num_kv_blocks=64) as llm:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids


def transformers_tokens(path: str, prompt: list[int]) -> list[int]:
    directory, name = os.path.split(path)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                         do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("tensor_type", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_llama_tensor_types_decode_like_transformers(gguf_factory, tensor_type):
    path = gguf_factory("llama", tensor_type)
    tokens = engine_tokens(path, PROMPT)
    assert tokens == transformers_tokens(path, PROMPT)
    assert len(set(tokens)) > 3, "a degenerate model would hide a wrong weight layout"


@pytest.mark.parametrize(("architecture", "tensor_type", "overrides"), [
    ("qwen2", "Q8_0", {}),
    ("qwen2", "Q4_K", {}),
    # transformers reads no head_dim from a Qwen3 GGUF and takes its default, 128:
    # use that, unlike hidden / heads (64), so the loader's head_dim is the file's own
    ("qwen3", "Q6_K", {"head_dim": 128}),
    ("mistral", "Q4_1", {}),  # written as "llama", as llama.cpp does
])
def test_other_architectures_decode_like_transformers(gguf_factory, architecture, tensor_type, overrides):
    path = gguf_factory(architecture, tensor_type, **overrides)
    assert engine_tokens(path, PROMPT) == transformers_tokens(path, PROMPT)


def test_config_comes_from_the_metadata(gguf_factory, tiny_model_factory):
    path = gguf_factory("qwen3", "Q8_0", head_dim=128)
    _, spec = load_model(path, "auto", "cpu")
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        "Qwen3ForCausalLM", 2, 4, 2)
    assert spec.head_dim == 128 and spec.hidden_size == 256
    reference = AutoTokenizer.from_pretrained(tiny_model_factory("qwen3", **{**DIMS, "head_dim": 128}))
    assert spec.vocab_size == len(reference)
    assert spec.eos_token_ids == [reference.eos_token_id]
    assert spec.torch_dtype == "bfloat16", "a quantized file serves in bf16 by default"
    _, f32_spec = load_model(gguf_factory("llama", "F32"), "auto", "cpu")
    assert f32_spec.torch_dtype == "float32"


def test_tied_embeddings_when_the_file_has_no_output_tensor(gguf_factory):
    tied = gguf_factory("llama", "Q8_0", tie_word_embeddings=True)
    model, _ = load_model(tied, torch.float32, "cpu")
    assert model.lm_head is None
    assert engine_tokens(tied, PROMPT) == transformers_tokens(tied, PROMPT)


def test_tokenizer_and_chat_template_come_from_the_file(gguf_factory, tiny_model_factory):
    path = gguf_factory("llama", "Q8_0")
    reference = AutoTokenizer.from_pretrained(tiny_model_factory("llama", **DIMS))
    with LLM(model=path, dtype="float32", num_kv_blocks=16) as llm:
        text = "The cache keeps blocks of tokens, 42 of them."
        assert llm.engine.encode(text) == reference(text)["input_ids"]
        messages = [{"role": "user", "content": "Hi!"}]
        expected = reference.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
        assert llm.engine.encode_chat(messages) == list(expected)
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert out[0].outputs[0].text == reference.decode(out[0].outputs[0].token_ids, skip_special_tokens=True)


def test_unsupported_architecture_is_named(tiny_model_factory, tmp_path):
    path = write_gguf(tiny_model_factory("llama", **DIMS), str(tmp_path / "f.gguf"), "F32", architecture="falcon")
    with pytest.raises(UnsupportedArchitectureError, match=r"'falcon'; supported: llama, qwen2, qwen3"):
        load_model(path, "auto", "cpu")


def test_unsupported_tensor_type_is_named(tiny_model_factory, tmp_path):
    path = write_gguf(tiny_model_factory("llama", **DIMS), str(tmp_path / "f.gguf"), "IQ4_NL")
    with pytest.raises(UnsupportedTensorTypeError, match=r"tensor [\w.]+\.weight has type IQ4_NL, which is not supported"):
        load_model(path, "auto", "cpu")


def test_a_file_that_is_not_gguf_is_a_load_error(tmp_path):
    from engine.models import ModelLoadError

    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_model(str(path), "auto", "cpu")
