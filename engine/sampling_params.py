"""Per-request sampling options, shaped like vLLM's SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class SamplingParamsError(ValueError):
    """A sampling option is out of range; `param` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match, as vLLM's `StructuredOutputsParams`: exactly one of a
    JSON schema (a dict or its JSON text), any JSON object, a regular expression, one of
    a list of strings, or a Lark grammar (llguidance's dialect, which may embed JSON
    schemas with `%json`). engine/structured_output.py compiles it."""

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [self.json is not None, self.json_object, self.regex is not None,
                 self.choice is not None, self.grammar is not None]
        if sum(given) != 1:
            raise SamplingParamsError(
                "structured_outputs", "give exactly one of json, json_object, regex, choice or grammar")
        if self.choice is not None and not (self.choice and all(isinstance(c, str) for c in self.choice)):
            raise SamplingParamsError("structured_outputs", "choice must be a non-empty list of strings")


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's meaning: None, no logprobs; k >= 0, the sampled token's logprob and the k
    # most likely tokens' (True and False, an older spelling, mean 0 and None)
    logprobs: int | None = None
    # vLLM's: None, none; k >= 0, each prompt token's logprob (after the first) and the k
    # most likely tokens at its position (the request then takes no prefix-cache hits)
    prompt_logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.logprobs, bool):
            self.logprobs = 0 if self.logprobs else None
        self.validate()

    def validate(self) -> None:
        if self.n < 1:
            raise SamplingParamsError("n", f"must be >= 1, got {self.n}")
        if self.logprobs is not None and self.logprobs < 0:
            raise SamplingParamsError("logprobs", f"must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise SamplingParamsError("prompt_logprobs", f"must be >= 0, got {self.prompt_logprobs}")
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise SamplingParamsError("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SamplingParamsError("top_k", f"must be >= 0 (0 disables), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p}")
        if any(not s for s in self.stop):
            raise SamplingParamsError("stop", "stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
