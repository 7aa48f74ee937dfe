"""Token sampling: greedy, temperature, min-p, top-k, top-p, per-request seeds, logprobs.

Filters apply in vLLM's order: temperature, then min-p (relative to the most likely
token), then top-k, then top-p over what top-k kept. A token is drawn with the
exponential race `argmax(probs / q)`, q ~ Exp(1), which is an exact draw from `probs`
and needs no cumulative sum. A request with its own generator draws its noise row from
that generator alone, so its tokens do not depend on the rest of the batch.

A row of logits with a NaN or +inf, or with no finite value, is no distribution: the
sampler raises NonFiniteLogitsError before drawing anything (no generator advances), and
the engine runs the step again without the rows that fail alone (LLMEngine._isolate), so
only those requests finish with an error.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.logprobs import TokenLogprob, TopLogprobs
from engine.sampling_params import SamplingParams

# Below this temperature a row is sampled greedily (dividing by it would overflow).
GREEDY_TEMPERATURE = 1e-5


class NonFiniteLogitsError(ArithmeticError):
    """The model produced NaN or infinite logits for some rows of a step."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__(
            "the model produced NaN or infinite logits (no distribution to sample from), "
            f"rows {rows} of the step"
        )
        self.rows = rows


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator; it must live on the device the logits are on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> tuple[list[int], list[TokenLogprob] | None, list[TopLogprobs] | None]:
        """One token per row of `logits` [n, V]. The logprobs (of the chosen tokens under
        the raw logits, as vLLM reports them, with their ranks) come for every row when
        any request asks, and with them each row's `params.logprobs` most likely tokens
        (id, logprob), most likely first (`token_logprobs`)."""
        if logits.dim() != 2 or not logits.shape[0] == len(params) == len(generators):
            raise ValueError("logits must be [n, vocab] with one params and generator per row")
        logits = logits.float()
        row_max, tokens = logits.max(dim=-1)  # one pass: the greedy tokens and the check
        bad = ~torch.isfinite(row_max)
        if any(g is not None for g in generators):
            _raise_for(bad)  # before a request's generator draws: a rerun draws the same
        rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE]
        if rows:
            tokens[rows] = _sample_rows(
                logits[rows], [params[i] for i in rows], [generators[i] for i in rows]
            )
        _raise_for(bad)  # the device sync here overlaps the sampling kernels queued above
        if not any(p.logprobs is not None for p in params):
            return tokens.tolist(), None, None
        logprobs, top = token_logprobs(logits, tokens, [p.logprobs or 0 for p in params])
        return tokens.tolist(), logprobs, top


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]
) -> tuple[list[TokenLogprob], list[TopLogprobs]]:
    """Per row of `logits` [n, V]: the logprob and rank of `token_ids[row]` under the raw
    logits, and the row's `num_top[row]` most likely tokens (id, logprob), most likely
    first. One log_softmax, one comparison and one topk for all rows: the sampled tokens
    of a step and the prompt tokens of a chunk (engine/model_runner.py) alike."""
    all_logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = all_logprobs.gather(1, token_ids[:, None])
    ranks = (all_logprobs >= chosen).sum(dim=-1).tolist()
    logprobs = [TokenLogprob(lp, rank) for lp, rank in zip(chosen.squeeze(1).tolist(), ranks, strict=True)]
    top: list[TopLogprobs] = [[] for _ in num_top]
    if max(num_top, default=0):
        values, ids = all_logprobs.topk(min(max(num_top), logits.shape[1]), dim=-1)
        values, ids = values.tolist(), ids.tolist()
        top = [list(zip(i[:k], v[:k], strict=True)) for i, v, k in zip(ids, values, num_top, strict=True)]
    return logprobs, top


def _raise_for(bad: torch.Tensor) -> None:
    """Raise NonFiniteLogitsError for the rows flagged in `bad`: rows whose maximum is not
    finite, i.e. a NaN anywhere (max propagates it), a +inf, or every logit -inf (-inf
    entries alone are masked tokens)."""
    if bool(bad.any()):
        raise NonFiniteLogitsError(bad.nonzero().flatten().tolist())


def _sample_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> torch.Tensor:
    temperature = logits.new_tensor([p.temperature for p in params])
    scaled = logits / temperature[:, None]
    scaled = apply_min_p(scaled, [p.min_p for p in params])
    scaled = apply_top_k_top_p(scaled, [p.top_k for p in params], [p.top_p for p in params])
    probs = scaled.softmax(dim=-1)
    return probs.div_(_exponential_noise(probs, generators)).argmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the top token's (0 disables)."""
    if not any(min_p):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * logits.new_tensor(min_p)[:, None]
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Keep the k most likely tokens (0 disables; ties with the k-th are kept), then the
    smallest most-likely set whose probability reaches top_p (1 disables)."""
    vocab = logits.shape[-1]
    use_k = any(0 < k < vocab for k in top_k)
    use_p = any(p < 1 for p in top_p)
    if not (use_k or use_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if use_k:
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=logits.device)
        kth = sorted_logits.gather(1, (k - 1)[:, None])
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if use_p:
        p = logits.new_tensor([p if p < 1 else float("inf") for p in top_p])
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits.masked_fill_(mass_before >= p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _exponential_noise(
    probs: torch.Tensor, generators: list[torch.Generator | None]
) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, generator in enumerate(generators):
        if generator is not None:
            noise[row].exponential_(generator=generator)
    # A zero draw would turn a masked (zero-probability) token into 0/0 = nan.
    return noise.clamp_(min=torch.finfo(noise.dtype).tiny)
