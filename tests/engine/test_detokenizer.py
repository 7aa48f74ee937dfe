"""Incremental detokenization (spaces, multi-byte characters) and stop strings.

Two tokenizers are trained in-process with `tokenizers` on a tiny ASCII corpus, so any
non-ASCII character is split into byte tokens: a GPT-2 style byte-level BPE and a Llama
style one (Metaspace with byte fallback and a stripped leading space)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.detokenizer import IncrementalDetokenizer, find_stop_string

CORPUS = ["hello world, the quick brown fox jumps over the lazy dog"] * 20 + [
    "stop here please and then go on with the end of text"
] * 20
TEXT = "the quick wörld 🙂 jumps 你好 over the end"


def byte_level_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def llama_style_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, unk_token="<unk>")
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    return tok


TOKENIZERS = {"byte_level": byte_level_tokenizer(), "llama_style": llama_style_tokenizer()}


@pytest.fixture(params=sorted(TOKENIZERS))
def tokenizer(request) -> Tokenizer:
    return TOKENIZERS[request.param]


def test_token_by_token_deltas_rebuild_the_text(tokenizer):
    prompt = tokenizer.encode("hello world,").ids
    output = tokenizer.encode(TEXT).ids
    assert len(output) > len(TEXT.split())  # multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.append([token]) for token in output]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) == detok.text == tokenizer.decode(prompt + output)[len("hello world,") :]
    assert "" in deltas  # some tokens only completed a character later


def test_leading_space_of_a_new_word_is_kept(tokenizer):
    prompt = tokenizer.encode("hello").ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    detok.append(tokenizer.encode("hello world").ids[len(prompt) :])
    assert detok.text == " world"


def test_several_tokens_at_once(tokenizer):
    output = tokenizer.encode(TEXT).ids
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.append(output[:5])
    detok.append(output[5:])
    assert detok.text == TEXT


def test_special_tokens_are_skipped_by_default():
    tokenizer = TOKENIZERS["byte_level"]
    eos = tokenizer.token_to_id("<eos>")
    ids = [*tokenizer.encode("the end").ids, eos]
    assert IncrementalDetokenizer(tokenizer, []).append(ids) == "the end"
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert kept.append(ids) == "the end<eos>"


def test_stop_string_spanning_two_tokens_is_cut(tokenizer):
    output = tokenizer.encode("go on with the end of text").ids
    detok = IncrementalDetokenizer(tokenizer, [])
    found = None
    for token in output:
        delta = detok.append([token])
        found = detok.check_stop(["the e"], len(delta))
        if found:
            break
    assert found == "the e"
    assert detok.text == "go on with "
    pieces = [tokenizer.decode([t]) for t in output]
    assert not any("the e" in piece for piece in pieces)


def test_find_stop_string_returns_the_earliest_match():
    assert find_stop_string("abc STOP def END", ["END", "STOP"]) == (4, "STOP")
    assert find_stop_string("abc", ["x"]) is None
    assert find_stop_string("xxSTOPSTOP", ["STOP", "TOPS"]) == (2, "STOP")
    assert find_stop_string("aXYb", ["XY", "X"]) == (1, "XY")


def test_find_stop_string_searches_only_the_new_tail():
    # "STOP" ended before the new characters: already reported by an earlier call.
    assert find_stop_string("STOP then more", ["STOP"], num_new_chars=4) is None
    # A match straddling old and new text is found.
    assert find_stop_string("abc ST" + "OP", ["STOP"], num_new_chars=2) == (4, "STOP")
    assert find_stop_string("abc STOP", ["STOP"], num_new_chars=1) == (4, "STOP")
    assert find_stop_string("abc STOP", ["STOP"], num_new_chars=0) is None
