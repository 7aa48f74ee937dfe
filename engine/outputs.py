"""What the engine returns for a request (shaped like vLLM's RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.logprobs import PromptLogprobs, SampleLogprobs, TopLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    # vLLM's: per token {token id: Logprob(logprob, rank, decoded_token)}, the sampled
    # token and the `SamplingParams.logprobs` most likely
    logprobs: SampleLogprobs | None = None
    # kvtier's: per token those most likely as (token id, logprob), most likely first
    top_logprobs: list[TopLogprobs] | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0
    num_external_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    # vLLM's, with `SamplingParams.prompt_logprobs`, once the prefill is done: None for the
    # first prompt token, then per token {token id: Logprob}, the token and the top k
    prompt_logprobs: PromptLogprobs | None = None
