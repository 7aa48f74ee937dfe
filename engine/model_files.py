"""What `--model` and `--tokenizer` point at, and the tokenizer they give, without torch.

`kvtier router` loads each instance's tokenizer to name a request's blocks as the
instance does, and needs nothing else of the model; this module is the one tokenizer
loader both use, so the two cannot differ, and what imports it alone leaves torch out.
transformers' AutoTokenizer imports torch (its configuration classes do) wherever torch
is installed, so a tokenizer whose `tokenizer_class` is transformers' generic fast
tokenizer (the built-in models', and many checkpoints') is loaded through that class,
which gives the same tokenizer; any other class, and a GGUF file's tokenizer, still go
through AutoTokenizer.
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import PreTrainedTokenizerFast

GGUF_SUFFIX = ".gguf"
# tokenizer_config.json's `tokenizer_class` names for which AutoTokenizer picks
# PreTrainedTokenizerFast itself (TokenizersBackend is its name since transformers 5)
GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def is_gguf(path: str | os.PathLike[str]) -> bool:
    return os.fspath(path).lower().endswith(GGUF_SUFFIX) and os.path.isfile(path)


def load_tokenizer(model_path: str, tokenizer_path: str | None = None) -> Any:
    """The tokenizer of `tokenizer_path` if given, else the model's own (a GGUF file
    carries its tokenizer in its metadata)."""
    if tokenizer_path is None and is_gguf(model_path):
        from engine.models.gguf import load_gguf_tokenizer

        return load_gguf_tokenizer(model_path)
    if tokenizer_path is not None and not os.path.isdir(tokenizer_path):
        from engine.models.args import ModelLoadError

        raise ModelLoadError(f"--tokenizer {tokenizer_path}: no such directory (this machine cannot download)")
    directory = tokenizer_path or model_path
    if _tokenizer_class(directory) in GENERIC_TOKENIZER_CLASSES:
        return PreTrainedTokenizerFast.from_pretrained(directory)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _tokenizer_class(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        return None  # built from vocabulary files by a model's own class
    return config.get("tokenizer_class") if isinstance(config, dict) else None
