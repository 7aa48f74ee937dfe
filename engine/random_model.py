"""Random-weight models: real Hugging Face checkpoints built locally, for tests and the
`builtin:tiny` and `builtin:random` models.

`make_model` writes config.json, safetensors weights, generation_config.json and a
byte-level BPE tokenizer with a chat template into a directory, using only transformers
and tokenizers (no download). Its text is meaningless; its shapes, cost and cache
behaviour are those of a real Llama-family model.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.utils import logging as hf_logging

from engine.models import resolve_dtype

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD, BOS, EOS]  # ids 0, 1, 2
BPE_VOCAB_TARGET = 768  # 3 special + 256 bytes + up to ~500 merges

ARCHITECTURES: dict[str, tuple[type, type]] = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}

# The std of HF's default init (0.02) makes greedy decoding of a random model repeat
# one token; a larger one keeps the generated tokens varied, which parity tests need.
INIT_STD = 0.1
# transformers initializes from the global RNG: one seeded build at a time per process
_INIT_LOCK = threading.Lock()

PRESETS: dict[str, dict[str, Any]] = {
    "default": {
        "num_hidden_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 1408,
        "max_position_embeddings": 32768,
        "dtype": "bfloat16",
    },
    "tiny": {
        "num_hidden_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "intermediate_size": 128,
        "max_position_embeddings": 4096,
        "dtype": "float32",
    },
}
# per-architecture changes to a preset; qwen3's head_dim differs from hidden / heads
ARCHITECTURE_PRESETS: dict[tuple[str, str], dict[str, Any]] = {
    ("qwen3", "tiny"): {"head_dim": 32},
    ("qwen3", "default"): {"head_dim": 128},
}

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

TRAINING_TEXT = """\
The cache keeps what was computed once so that it need not be computed again. When a
long document comes back, the model reads its keys and values from memory instead of
running the whole prompt through every layer. Memory on the device is small and fast;
the host has more of it, the disk has even more, and a shared server lets many machines
use the same store. Each block of tokens is named by a hash of everything before it, so
two requests that start with the same words find the same blocks.
A question about a report, a chat that goes on for many turns, an agent that replays its
history: all of them send the same beginning again and again. Without a cache the engine
would spend most of its time on work it has already done. With one, the first token of
the answer arrives sooner, and more requests fit on the same hardware.
The scheduler decides which requests run in each step. It gives the running ones their
next token first, then it takes waiting ones while the token budget lasts. Long prompts
are cut into chunks, and a chunk of one request can share a step with the decodes of
others. When memory runs out, the newest request is paused and its blocks are saved, so
that it can continue later from where it stopped.
Numbers, names and places appear in ordinary text too: the meeting is on Monday at ten,
the train leaves from the north station, the price was 42 dollars, and the file is
called notes.txt. People ask for help, they say thank you, and they write code such as
def main(): return 0, or if x > 1: print(x).
Every morning the small team looked at the numbers from the night before. How many
requests came in, how long did each one wait, and how much of the work was found in the
cache? They wrote down what they saw, they changed one thing at a time, and they ran the
tests again. When something was slow they measured it before they tried to make it
faster, because a guess about where the time goes is wrong more often than it is right.
Good tools are simple to start, easy to read, and hard to use in the wrong way. A clear
error message that says what happened and what to do next is worth more than a long
manual. The best systems are the ones that keep working when a disk is full, a network
link goes down, or a server restarts in the middle of the day.
"""


def make_model(
    path: str,
    architecture: str = "llama",
    preset: str = "default",
    seed: int = 0,
    **overrides: Any,
) -> str:
    """Write a random-weight checkpoint with tokenizer into `path`; returns `path`.

    `overrides` are config fields (e.g. `tie_word_embeddings=True`, `rope_scaling={...}`).
    The same arguments always produce the same bytes.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(
            f"unknown architecture {architecture!r}; expected one of {list(ARCHITECTURES)}"
        )
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {list(PRESETS)}")
    os.makedirs(path, exist_ok=True)
    tokenizer = build_tokenizer()
    config = _config(architecture, preset, len(tokenizer), overrides)
    config_cls, model_cls = ARCHITECTURES[architecture]
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**config))
    model.to(resolve_dtype(config["dtype"]))
    model.generation_config = GenerationConfig(
        bos_token_id=config["bos_token_id"],
        eos_token_id=config["eos_token_id"],
        pad_token_id=config["pad_token_id"],
    )
    _save_quietly(model, path)
    tokenizer.save_pretrained(path)
    return path


def _save_quietly(model: Any, path: str) -> None:
    """save_pretrained without transformers' shard-writing progress bar, which would
    otherwise be the first lines on stderr of a command that builds a built-in model."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path, safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _config(
    architecture: str, preset: str, vocab: int, overrides: dict[str, Any]
) -> dict[str, Any]:
    config = {
        **PRESETS[preset],
        **ARCHITECTURE_PRESETS.get((architecture, preset), {}),
        "vocab_size": vocab,
        "initializer_range": INIT_STD,
        "pad_token_id": SPECIAL_TOKENS.index(PAD),
        "bos_token_id": SPECIAL_TOKENS.index(BOS),
        "eos_token_id": SPECIAL_TOKENS.index(EOS),
        "tie_word_embeddings": False,
        **overrides,
    }
    if config["vocab_size"] < vocab:
        raise ValueError(f"vocab_size must be at least the tokenizer's {vocab}")
    return config


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (every byte is a token, so any text encodes) with merges learnt from
    `TRAINING_TEXT`, `<s>` prepended on encode, and a chat template."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_TARGET,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
