"""Structured outputs: a grammar per request that masks the logits of every step it samples.

The grammar engine is llguidance, behind the two small classes here (`GrammarCompiler`
and `Grammar`); nothing else in kvtier imports it. It was chosen over xgrammar and
outlines-core because it needs no torch or triton of its own (xgrammar pins both), builds
the mask of a 49k vocabulary in about 0.1 ms without a per-schema precomputation
(outlines-core compiles a whole automaton per schema first), takes JSON schemas, regular
expressions and Lark grammars with embedded JSON schemas (which tool calls need), and
releases the GIL while it computes masks, so the masks of a step are built on a worker
thread while the forward runs (`MaskBuilder`).

A `Grammar` follows one sequence: `fill_mask` writes the tokens allowed next as a packed
bitmask (one bit a token, int32 words), `accept` advances over the sampled token, and
`is_terminated` says that the grammar is complete and the sequence should stop. When the
grammar is complete only the end-of-sequence tokens are allowed. `forced_tokens` gives
the text the grammar leaves no choice about, which the scheduler appends at once
(jump-forward decoding, as SGLang calls it) instead of sampling it a token a step.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParamsError, StructuredOutputsParams

if TYPE_CHECKING:
    import torch

# Compiled grammars kept for reuse (agents send the same schema or tools every turn).
COMPILED_CACHE_SIZE = 256
# JSON is generated with the separators of Python's json.dumps and no other whitespace: a
# small model left free to add whitespace may pad forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(SamplingParamsError):
    """A schema, regex, choice list or grammar the engine cannot compile; `param` names
    the request field that held it."""


class Grammar:
    """The grammar state of one sequence."""

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size  # tokens the mask covers

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of an int32 [rows, words] bitmask."""
        view = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token; False if the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows as the only way on from here (the fixed text of a
        tool call's head, a schema's next key), not yet accepted."""
        return self._matcher.compute_ff_tokens()

    def is_terminated(self) -> bool:
        return self._matcher.is_stopped()

    def error(self) -> str | None:
        return self._matcher.get_error() if self._matcher.is_error() else None


class GrammarCompiler:
    """Compiles `StructuredOutputsParams` into `Grammar`s for one tokenizer. Thread-safe: the
    server compiles a request's grammar in a worker thread first (a large schema can take
    hundreds of milliseconds), so that the engine thread then finds it in the cache."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_ids = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()

    def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> Grammar:
        """A fresh `Grammar` of `params` (from the cache when compiled before); raises
        GrammarError naming `param` when it cannot be compiled."""
        import llguidance

        source = grammar_source(params, param)
        with self._lock:
            template = self._compiled.get(source)
            if template is not None:
                self._compiled.move_to_end(source)
                return Grammar(template.deep_copy(), self._vocab_size)
            tokenizer = self._tokenizer()
        template = llguidance.LLMatcher(tokenizer, source, log_level=0)
        if template.is_error():
            raise GrammarError(param, f"cannot be compiled: {template.get_error()}")
        with self._lock:
            self._compiled[source] = template
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return Grammar(template.deep_copy(), self._vocab_size)

    def _tokenizer(self) -> Any:
        """llguidance's view of the vocabulary, built once (about a second)."""
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_ids
            )
        return self._ll_tokenizer


def grammar_source(params: StructuredOutputsParams, param: str = "structured_outputs") -> str:
    """The llguidance grammar text of `params`; GrammarError for input that is not even
    well-formed (a schema that is not a JSON object, say)."""
    from llguidance import LLMatcher, grammar_from

    try:
        if params.json is not None:
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be a JSON object")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if params.json_object:
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if params.regex is not None:
            return LLMatcher.grammar_from_regex(params.regex)
        if params.choice is not None:
            return grammar_from("choice", json.dumps(params.choice))
        return grammar_from("lark", params.grammar)
    except ValueError as exc:
        raise GrammarError(param, f"cannot be compiled: {exc}") from None


class MaskBuilder:
    """Builds a step's token masks on a worker thread while the forward runs. `start`
    returns a future of the bitmask [len(grammars), words]; `apply_masks` applies it."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")

    def start(self, grammars: Sequence[Grammar]) -> concurrent.futures.Future:
        return self._pool.submit(_fill_masks, list(grammars))


def _fill_masks(grammars: list[Grammar]) -> torch.Tensor:
    import torch

    words = max((g.vocab_size + 31) // 32 for g in grammars)
    bitmask = torch.zeros((len(grammars), words), dtype=torch.int32)
    for row, grammar in enumerate(grammars):
        grammar.fill_mask(bitmask, row)
    return bitmask


def apply_masks(logits: torch.Tensor, rows: Sequence[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in `rows` of `logits` [n, V], every token the matching bitmask row
    leaves out (tokens past the bitmask's width included)."""
    import torch

    import kvkernels

    kvkernels.apply_token_bitmask(logits, bitmask, torch.tensor(list(rows), dtype=torch.long))
