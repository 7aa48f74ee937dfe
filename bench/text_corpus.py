"""Real English text that needs no network: the plain-text pydoc of Python standard
library modules, for benchmark prompts and real-model tests.

pydoc prints memory addresses (`<object at 0x7f...>`) that differ per process, and the
path of each module's file, which differs per machine; both are removed so that the
same call gives the same text, and so the same tokens, in every process: prompts built
from it share prefixes across instances, as real documents do. The text follows the
Python version, so results name it (bench.common records it).
"""

from __future__ import annotations

import functools
import importlib
import pydoc
import random
import re
from collections.abc import Sequence
from typing import Any

MODULES = (
    "collections", "json", "argparse", "asyncio.tasks", "textwrap", "heapq", "functools",
    "itertools", "pathlib", "statistics", "fractions", "decimal", "datetime", "calendar",
    "csv", "sqlite3", "logging", "email.message", "http.client", "urllib.parse", "zipfile",
    "tarfile", "shutil", "subprocess", "threading", "queue", "string", "re", "difflib",
    "unittest.case", "random", "enum", "dataclasses", "typing", "inspect", "pickle", "copy",
    "bisect", "base64", "hashlib", "contextlib", "os", "io", "socket", "selectors",
    "configparser", "gettext", "locale", "operator", "pprint", "sched", "tempfile", "uuid",
    "wave", "zlib", "html.parser", "xml.dom.minidom", "ftplib", "imaplib", "smtplib",
)
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_FILE_SECTION = re.compile(r"^FILE\n(?:    .*\n)+", re.MULTILINE)
_BACKSPACE = re.compile(r".\x08")  # pydoc's bold: a character, backspace, the character again
_GUTTER = re.compile(r"^[ |]*\| ?", re.MULTILINE)  # the bars pydoc draws left of class members


@functools.cache
def module_text(name: str) -> str:
    """pydoc's plain-text page of one module, the same in every process and machine."""
    text = pydoc.render_doc(importlib.import_module(name), renderer=pydoc.plaintext)
    text = _BACKSPACE.sub("", text)
    text = _FILE_SECTION.sub("", text)
    text = _GUTTER.sub("", text)
    return _ADDRESS.sub("", text)


def documents(count: int, min_chars: int, max_chars: int | None = None, seed: int = 0) -> list[str]:
    """`count` disjoint passages of real text of between `min_chars` and `max_chars`
    (default: `min_chars`) characters, each ending at a line end, consecutive from a
    point of the corpus that `seed` picks (wrapping round at its end)."""
    max_chars = max_chars or min_chars
    rng = random.Random(seed)
    stream = _corpus_text()
    if max_chars * 2 > len(stream):
        raise ValueError(f"{max_chars}-character passages are too long for the corpus")
    offset = rng.randrange(len(stream))
    out: list[str] = []
    for _ in range(count):
        size = rng.randint(min_chars, max_chars)
        if offset + size > len(stream):
            offset = 0
        passage = stream[offset : offset + size]
        cut = passage.rfind("\n", size // 2)
        passage = passage[: cut if cut > 0 else size]
        offset += len(passage) + 1
        out.append(passage.strip())
    return out


@functools.cache
def _corpus_text() -> str:
    return "\n".join(module_text(name) for name in MODULES)


@functools.cache
def _corpus_tokens(tokenizer: Any) -> tuple[int, ...]:
    return tuple(tokenizer.encode(_corpus_text(), add_special_tokens=False))


class CorpusTokens:
    """Runs of consecutive tokens of the corpus, tokenized by one model's tokenizer: the
    real-text stand-in for random token ids in the benchmark workloads."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokens = _corpus_tokens(tokenizer)

    @classmethod
    def for_model(cls, model_path: str) -> CorpusTokens:
        from engine.models import load_tokenizer

        return cls(load_tokenizer(model_path))

    def take(self, rng: random.Random, n: int) -> list[int]:
        """`n` consecutive tokens from a point `rng` picks."""
        if n > len(self.tokens):
            raise ValueError(f"{n} tokens are more than the corpus holds ({len(self.tokens)})")
        start = rng.randrange(len(self.tokens) - n + 1)
        return list(self.tokens[start : start + n])


def passage_tokens(tokenizer: Any, n: int, seed: int = 0) -> list[int]:
    """The first `n` tokens of one passage of the corpus that `seed` picks; only that
    passage is tokenized (cheap enough for every engine's warm-up)."""
    ids = tokenizer.encode(documents(1, 8 * n, seed=seed)[0], add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"a passage of {8 * n} characters holds only {len(ids)} tokens, not {n}")
    return ids[:n]


def token_documents(tokenizer: Any, lengths: Sequence[int], seed: int = 0) -> list[list[int]]:
    """One token list per entry of `lengths`, each a run of that many consecutive tokens
    of the tokenized corpus, the runs disjoint while the corpus lasts (then it wraps).
    `seed` picks where the first run starts."""
    corpus = _corpus_tokens(tokenizer)
    total = len(corpus)
    start = random.Random(seed).randrange(total)
    out = []
    for length in lengths:
        if length > total:
            raise ValueError(f"a {length}-token document is longer than the corpus ({total} tokens)")
        if start + length > total:
            start = 0
        out.append(list(corpus[start : start + length]))
        start += length
    return out
