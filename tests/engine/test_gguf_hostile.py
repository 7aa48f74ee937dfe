"""Hostile GGUF metadata (issue 44, item 7): every field is checked against sane bounds,
the other fields and the tensor shapes before anything is allocated from it, and each
bad file is a one-line error naming the field.

The files are the tiny model of tests/engine/gguf_files.py with one metadata edit each
(or a tensor's dims rewritten in place). "Nothing allocated" is checked structurally:
the model class is replaced by one that fails the test if it is ever built, so every
file must be refused from its metadata alone (before, 10^9 layers or a 2^40-position
rope table went to the model builder)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_writer import GGUFValue

import engine.models.loader as loader_module
from engine.cli import main
from engine.models import ModelLoadError, load_model
from engine.models.gguf import GGUFMetadataError
from tests.engine.gguf_files import write_gguf

U64 = GGUFValueType.UINT64
HOSTILE = {  # case -> (metadata edits, the field the error must name)
    "layers 10^9": ({"llama.block_count": 10**9}, "llama.block_count"),
    "layers 0": ({"llama.block_count": 0}, "llama.block_count"),
    "layers beyond the tensors": ({"llama.block_count": 3}, "llama.block_count"),
    "layers as a string": ({"llama.block_count": GGUFValue("2", GGUFValueType.STRING)}, "llama.block_count"),
    "context 0": ({"llama.context_length": 0}, "llama.context_length"),
    "context 2^40": ({"llama.context_length": GGUFValue(2**40, U64)}, "llama.context_length"),
    "no context": ({"llama.context_length": None}, "llama.context_length"),
    "hidden 2^40": ({"llama.embedding_length": GGUFValue(2**40, U64)}, "llama.embedding_length"),
    "hidden not the tensors'": ({"llama.embedding_length": 128}, "llama.embedding_length"),
    "ffn 2^31": ({"llama.feed_forward_length": 2**31}, "llama.feed_forward_length"),
    "ffn not the tensors'": ({"llama.feed_forward_length": 256}, "llama.feed_forward_length"),
    "heads 0": ({"llama.attention.head_count": 0}, "llama.attention.head_count"),
    "heads 10^6": ({"llama.attention.head_count": 10**6}, "llama.attention.head_count"),
    "heads not divisible by kv heads": ({"llama.attention.head_count": 3}, "llama.attention.head_count_kv"),
    "kv heads not dividing heads": ({"llama.attention.head_count_kv": 3}, "llama.attention.head_count_kv"),
    "kv heads 0": ({"llama.attention.head_count_kv": 0}, "llama.attention.head_count_kv"),
    "heads not the tensors'": ({"llama.attention.head_count": 2}, "llama.attention.head_count"),
    "head dim odd": ({"llama.attention.key_length": 15}, "llama.attention.key_length"),
    "head dim 10^6": ({"llama.attention.key_length": 10**6}, "llama.attention.key_length"),
    "head dim not the tensors'": ({"llama.attention.key_length": 32, "llama.attention.value_length": 32,
                                   "llama.rope.dimension_count": 32}, "llama.attention.key_length"),
    "value dim not the key dim": ({"llama.attention.value_length": 32}, "llama.attention.value_length"),
    "partial rotary": ({"llama.rope.dimension_count": 8}, "llama.rope.dimension_count"),
    "vocab 10^9": ({"llama.vocab_size": 10**9}, "llama.vocab_size"),
    "vocab below the tokenizer's": ({"llama.vocab_size": 100}, "llama.vocab_size"),
    "vocab not the embedding's": ({"llama.vocab_size": 1000}, "llama.vocab_size"),
    "eps nan": ({"llama.attention.layer_norm_rms_epsilon": float("nan")}, "llama.attention.layer_norm_rms_epsilon"),
    "eps 0": ({"llama.attention.layer_norm_rms_epsilon": 0.0}, "llama.attention.layer_norm_rms_epsilon"),
    "eps negative": ({"llama.attention.layer_norm_rms_epsilon": -1.0}, "llama.attention.layer_norm_rms_epsilon"),
    "no eps": ({"llama.attention.layer_norm_rms_epsilon": None}, "llama.attention.layer_norm_rms_epsilon"),
    "rope theta inf": ({"llama.rope.freq_base": float("inf")}, "llama.rope.freq_base"),
    "rope theta 0": ({"llama.rope.freq_base": 0.0}, "llama.rope.freq_base"),
    "yarn without a factor": ({"llama.rope.scaling.type": "yarn"}, "llama.rope.scaling.factor"),
    "linear factor nan": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": float("nan")},
                          "llama.rope.scaling.factor"),
    "linear factor 0": ({"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 0.0},
                        "llama.rope.scaling.factor"),
    "yarn factor 10^6": ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 1e6},
                         "llama.rope.scaling.factor"),
    "yarn original context 0": ({"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0,
                                 "llama.rope.scaling.original_context_length": 0},
                                "llama.rope.scaling.original_context_length"),
    "unknown rope scaling": ({"llama.rope.scaling.type": "dynamic", "llama.rope.scaling.factor": 2.0},
                             "llama.rope.scaling.type"),
    "sliding window 2^40": ({"llama.attention.sliding_window": GGUFValue(2**40, U64)},
                            "llama.attention.sliding_window"),
    "eos id past the vocab": ({"tokenizer.ggml.eos_token_id": 100000}, "tokenizer.ggml.eos_token_id"),
    "bos id negative": ({"tokenizer.ggml.bos_token_id": GGUFValue(-1, GGUFValueType.INT32)},
                        "tokenizer.ggml.bos_token_id"),
}


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory) -> str:
    return tiny_model_factory("llama")


@pytest.fixture
def no_model_built(monkeypatch):
    """Fail the test if the model (the allocation the metadata sizes) is ever built."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was built from unchecked metadata")

    monkeypatch.setattr(loader_module, "CausalLM", refuse)


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_metadata_is_one_line_naming_the_field(case, checkpoint, tmp_path, no_model_built):
    edits, field = HOSTILE[case]
    path = write_gguf(checkpoint, str(tmp_path / "hostile.gguf"), metadata=edits)
    with pytest.raises(GGUFMetadataError) as caught:
        load_model(path, "float32", "cpu")
    message = str(caught.value)
    assert message.startswith(f"{path}: GGUF metadata ") and "\n" not in message, message
    assert re.search(rf"{re.escape(field)}\b(?!_)", message), message


def rewrite_dims(source: str, target: Path, tensor: str, dims: list[int]) -> str:
    """A copy of `source` whose tensor `tensor` declares `dims` (GGUF order) in place."""
    shutil.copy(source, target)
    reader = GGUFReader(target, "r+")
    info = next(t for t in reader.tensors if t.name == tensor)
    info.field.parts[3][:] = dims  # parts: name length, name, n_dims, dims, type, offset
    del reader  # flushes the memory map
    return str(target)


@pytest.mark.parametrize(("dims", "match"), [
    ([64, 2**40], r"not a readable GGUF file \(cannot reshape"),  # more data than the file holds
    ([2**33, 487], r"not a readable GGUF file \(cannot reshape"),
    ([32, 974], r"GGUF metadata llama\.vocab_size = 487: disagrees with tensor token_embd\.weight"),
])
def test_tensor_shapes_the_metadata_does_not_give_are_refused(dims, match, checkpoint, tmp_path, no_model_built):
    valid = write_gguf(checkpoint, str(tmp_path / "valid.gguf"))
    path = rewrite_dims(valid, tmp_path / "tampered.gguf", "token_embd.weight", dims)
    with pytest.raises(ModelLoadError, match=match) as caught:
        load_model(path, "float32", "cpu")
    assert "\n" not in str(caught.value)


def test_the_cli_prints_one_line_and_no_traceback(checkpoint, tmp_path, capsys, no_model_built):
    path = write_gguf(checkpoint, str(tmp_path / "hostile.gguf"), metadata={"llama.block_count": 10**9})
    with pytest.raises(SystemExit) as exited:
        main(["generate", "--model", path, "--prompt", "hi", "--max-tokens", "1", "--dtype", "float32"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err == f"kvtier generate: error: {path}: GGUF metadata llama.block_count = 1000000000: must be in [1, 1024]\n"


def test_a_valid_file_with_a_zero_sliding_window_still_loads(checkpoint, tmp_path):
    path = write_gguf(checkpoint, str(tmp_path / "valid.gguf"), metadata={"llama.attention.sliding_window": 0})
    _, spec = load_model(path, "float32", "cpu")
    assert spec.num_layers == 2 and spec.max_position_embeddings == 4096
