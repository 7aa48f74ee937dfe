"""What enters the model fingerprint besides the weights (issue 44, item 1): the parsed
config (a change that alters the KV alters it, formatting does not), and the tokenizer.
tests/connectors/test_config_fingerprint.py shows the end-to-end effect on shared tiers."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.llm_engine import model_fingerprint
from engine.models import load_model, load_tokenizer, tokenizer_digest
from engine.models.args import args_from_config
from engine.models.gguf import GGUFCheckpoint
from engine.models.loader import read_config
from tests.engine.gguf_files import write_gguf


def config_digest(path: str | Path) -> str:
    return args_from_config(read_config(str(path))).digest


def rewritten(source: str, target: Path, drop: tuple[str, ...] = (), **changes) -> Path:
    """A copy of checkpoint `source` whose config.json is reformatted, without the keys
    in `drop` and with `changes`."""
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config = {key: value for key, value in config.items() if key not in drop} | changes
    (target / "config.json").write_text(json.dumps(config, indent=7) + "\n\n")
    return target


def rope(**params) -> dict:
    return {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default", **params}}


def test_formatting_and_spelling_keep_the_config_digest(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama")
    same = rewritten(path, tmp_path / "same", rms_norm_eps=0.000001, **rope(rope_theta=10000))
    assert json.loads((same / "config.json").read_text())["rope_parameters"]["rope_theta"] == 10000
    legacy = rewritten(path, tmp_path / "legacy", drop=("rope_parameters",), rope_theta=10000.0)
    assert config_digest(same) == config_digest(legacy) == config_digest(path)
    other = rewritten(path, tmp_path / "other", drop=("rope_parameters",), rope_theta=50.0)
    assert config_digest(other) != config_digest(path)


@pytest.mark.parametrize(
    "change",
    [
        rope(rope_theta=500000.0),
        {"rms_norm_eps": 1e-5},
        rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
        rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=16.0),
        rope(rope_type="linear", factor=2.0),
        rope(partial_rotary_factor=0.5),  # refused at load, still a different config
        {"max_position_embeddings": 2048},  # the default rope's original length follows it
        {"num_key_value_heads": 4},
        {"head_dim": 8},
    ],
    ids=lambda change: json.dumps(change)[:60],
)
def test_a_config_change_that_alters_the_kv_changes_the_digest(change, tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama")
    assert config_digest(rewritten(path, tmp_path / "changed", **change)) != config_digest(path)


def test_a_gguf_file_has_a_config_digest_that_follows_its_metadata(tiny_model_factory, tmp_path):
    base = write_gguf(tiny_model_factory("llama"), str(tmp_path / "a.gguf"))
    other = write_gguf(tiny_model_factory("llama", rope_theta=50.0), str(tmp_path / "b.gguf"))
    digests = [args_from_config(SimpleNamespace(**GGUFCheckpoint(p).config)).digest for p in (base, other)]
    assert digests[0] != digests[1]


def test_the_tokenizer_digest_is_its_identity_not_its_file(tiny_model_factory, tmp_path):
    path = tiny_model_factory("llama")
    tokenizer = load_tokenizer(path)
    copy = tmp_path / "copy"
    shutil.copytree(path, copy)
    raw = json.loads((copy / "tokenizer.json").read_text())
    (copy / "tokenizer.json").write_text(json.dumps(raw, indent=3))
    assert tokenizer_digest(load_tokenizer(str(copy))) == tokenizer_digest(tokenizer)
    tokenizer.add_tokens(["<extra-token>"])
    assert tokenizer_digest(tokenizer) != tokenizer_digest(load_tokenizer(str(copy)))


def test_the_fingerprint_holds_config_tokenizer_dtype_and_block_size(tiny_model_factory):
    _, spec = load_model(tiny_model_factory("llama"), "float32", "cpu")
    base = model_fingerprint(spec, torch.float32, 16, "a" * 64)
    variants = [
        model_fingerprint(spec, torch.float32, 16, "b" * 64),
        model_fingerprint(spec, torch.bfloat16, 16, "a" * 64),
        model_fingerprint(spec, torch.float32, 32, "a" * 64),
        model_fingerprint(replace(spec, config_digest="c" * 64), torch.float32, 16, "a" * 64),
    ]
    assert len({base.digest, *(v.digest for v in variants)}) == 5
