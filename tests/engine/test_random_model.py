"""Random-weight checkpoints (engine/random_model.py): tokenizer, chat template,
determinism, and the random built-in models made on first use."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoTokenizer

from engine import builtin_models
from engine.builtin_models import resolve_model
from engine.models import load_model, resolve_dtype
from engine.random_model import make_model

TEXT = "The cache keeps blocks of tokens. Ünïcödé, emoji 🙂 and\nnew lines, tabs\tand  spaces."


@pytest.fixture(scope="module")
def tiny_path(tiny_model_factory):
    return tiny_model_factory("llama")


def test_tokenizer_round_trip(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.bos_token_id == 1
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert tok.decode(ids, skip_special_tokens=True) == TEXT
    assert len(ids) < len(TEXT.encode()), "merges should make text shorter than its bytes"


def test_chat_template(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s>system: Be brief.</s>\nuser: Hi!</s>\nassistant: "
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert ids == tok(text, add_special_tokens=False)["input_ids"]


def test_vocab_matches_tokenizer_and_config(tiny_path):
    tok = AutoTokenizer.from_pretrained(tiny_path)
    _, spec = load_model(tiny_path, torch.float32, "cpu")
    assert spec.vocab_size == len(tok)
    assert spec.eos_token_ids == [tok.eos_token_id]


def test_same_seed_same_bytes(tmp_path):
    a = make_model(str(tmp_path / "a"), preset="tiny", seed=3)
    b = make_model(str(tmp_path / "b"), preset="tiny", seed=3)
    c = make_model(str(tmp_path / "c"), preset="tiny", seed=4)
    digests = [load_model(p, torch.float32, "cpu")[1].weights_digest for p in (a, b, c)]
    assert digests[0] == digests[1] != digests[2]


def test_unknown_architecture_or_preset(tmp_path):
    with pytest.raises(ValueError, match="architecture"):
        make_model(str(tmp_path), architecture="gpt2")
    with pytest.raises(ValueError, match="preset"):
        make_model(str(tmp_path), preset="huge")


def test_random_builtin_is_built_once(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = resolve_model("builtin:random")
    assert path == str(tmp_path / "kvtier" / "models" / "builtin-llama-v1")
    mtime = os.path.getmtime(os.path.join(path, "model.safetensors"))
    assert resolve_model("builtin:random") == path
    assert os.path.getmtime(os.path.join(path, "model.safetensors")) == mtime
    assert os.listdir(os.path.dirname(path)) == ["builtin-llama-v1"]
    _, spec = load_model(path, "auto", "cpu")
    assert spec.torch_dtype == "bfloat16" and resolve_dtype("auto", path) == torch.bfloat16
    assert (spec.num_layers, spec.hidden_size, spec.num_kv_heads, spec.head_dim) == (8, 512, 2, 64)
    assert spec.max_position_embeddings == 32768
    _, tiny = load_model(resolve_model("builtin:tiny"), "auto", "cpu")
    assert (tiny.num_layers, tiny.hidden_size) == (2, 64)


def test_random_builtin_lost_race(tmp_path, monkeypatch):
    """Another process renames its build into place first: ours is dropped, no error."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    final = tmp_path / "kvtier" / "models" / "builtin-llama-v1"

    def racing_install(path: str, wheel: str | None, progress: builtin_models.Progress) -> None:
        (final / "config.json").parent.mkdir(parents=True)
        (final / "config.json").write_text("{}")
        (tmp_path / "kvtier" / "models" / os.path.basename(path) / "x").write_text("partial")

    model = builtin_models.BUILTIN_MODELS["random"]
    monkeypatch.setitem(builtin_models.BUILTIN_MODELS, "random",
                        builtin_models.BuiltinModel(model.name, model.description, model.directory,
                                                    racing_install, needs_download=False))
    assert resolve_model("builtin:random") == str(final)
    assert os.listdir(final.parent) == ["builtin-llama-v1"]


def test_making_a_model_writes_nothing_to_the_terminal(tmp_path, capfd):
    make_model(str(tmp_path / "quiet"), "llama", "tiny")
    out, err = capfd.readouterr()
    assert (out, err) == ("", "")
