"""A request's state as it moves through the scheduler."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.logprobs import TokenLogprob, TopLogprobs
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output import Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def finished(self) -> bool:
        return self.name.startswith("FINISHED")


@dataclass
class Request:
    """Token state of one request. `block_hashes` holds the chained hash of every full
    block of `all_token_ids` (prompt and output), extended as tokens are appended.
    WAITING_FOR_REMOTE_KV: admitted, its blocks allocated, waiting for a KV store load."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    # with `prompt_logprobs`: those of prompt tokens 1, 2, ... (token 0 has none), in order
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_computed_tokens: int = 0
    peak_computed_tokens: int = 0  # most tokens ever computed: beyond a resume, work redone
    num_cached_tokens: int = -1  # device and store hits at first admission (-1: not yet)
    num_external_tokens: int = 0  # of those, tokens loaded from the KV store
    external_tiers: list[tuple[str, int]] = field(default_factory=list)  # (tier, tokens) runs of those, in order
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    grammar: Grammar | None = None  # structured outputs: what the output must match, followed

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt tokens whose logprobs are asked for and not computed yet."""
        if self.sampling_params.prompt_logprobs is None:
            return 0
        return self.num_prompt_tokens - 1 - len(self.prompt_logprobs)

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """Whether KV may not come from the prefix cache or the KV store: prompt logprobs
        come from the logits of every prompt position, which a cache hit skips (vLLM v1
        skips the cache for such requests too). Once they are all in, a resume may hit."""
        return self.num_prompt_logprobs_missing > 0

    def add_prompt_logprobs(self, first: int, logprobs: list[TokenLogprob], top: list[TopLogprobs]) -> None:
        """Record the logprobs of prompt tokens `first`, `first` + 1, ... (a chunk of the
        prefill; a chunk computed again after a preemption records only what is new)."""
        known = len(self.prompt_logprobs) + 1
        if first > known:
            raise ValueError(f"prompt logprobs from token {first}, but only up to token {known - 1} are known")
        self.prompt_logprobs += logprobs[known - first :]
        self.prompt_top_logprobs += top[known - first :]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None

    def append_output_token(
        self, token_id: int, logprob: TokenLogprob | None = None, top: TopLogprobs | None = None
    ) -> None:
        self.output_token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.accept(token_id):
            self.error = f"token {token_id} does not match the structured output: {self.grammar.error()}"
        if logprob is not None:
            self.output_logprobs.append(logprob)
            self.output_top_logprobs.append(top or [])
        if self.first_token_time is None:
            self.first_token_time = time.monotonic()
