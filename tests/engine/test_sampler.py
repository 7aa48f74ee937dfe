"""Greedy, seeded and filtered sampling; statistical checks on a fixed small distribution."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import (
    NonFiniteLogitsError,
    Sampler,
    apply_min_p,
    apply_top_k_top_p,
    make_generator,
    token_logprobs,
)
from engine.sampling_params import SamplingParams

# Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()
DRAWS = 20_000


def draw(params: SamplingParams, n: int = DRAWS) -> torch.Tensor:
    """Empirical distribution of `n` draws (one batch of n identical rows)."""
    torch.manual_seed(0)
    tokens, _, _ = Sampler().sample(LOGITS.expand(n, -1).clone(), [params] * n, [None] * n)
    return torch.bincount(torch.tensor(tokens), minlength=len(PROBS)).float() / n


def assert_distribution(observed: torch.Tensor, expected: list[float]) -> None:
    expected_t = torch.tensor(expected)
    # Five standard deviations of a binomial proportion.
    tolerance = 5 * (expected_t * (1 - expected_t) / DRAWS).sqrt() + 1e-9
    assert ((observed - expected_t).abs() <= tolerance).all(), (observed, expected)


def test_greedy_is_argmax():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0)] * 8
    tokens, logprobs, _ = Sampler().sample(logits, params, [None] * 8)
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs is None


def test_temperature_one_follows_the_softmax():
    assert_distribution(draw(SamplingParams(temperature=1.0)), PROBS.tolist())


def test_temperature_scales_the_logits():
    expected = torch.softmax(LOGITS / 2.0, dim=-1).tolist()
    assert_distribution(draw(SamplingParams(temperature=2.0)), expected)


def test_top_k_keeps_the_k_most_likely():
    assert_distribution(draw(SamplingParams(top_k=2)), [0.5 / 0.8, 0.3 / 0.8, 0, 0])


def test_top_p_keeps_the_smallest_set_reaching_p():
    assert_distribution(draw(SamplingParams(top_p=0.75)), [0.5 / 0.8, 0.3 / 0.8, 0, 0])
    assert_distribution(draw(SamplingParams(top_p=0.9)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    assert_distribution(draw(SamplingParams(top_p=0.4)), [1, 0, 0, 0])


def test_top_p_applies_after_top_k():
    # top-k 3 renormalizes to 0.5/0.95 = 0.526...; top-p 0.5 then keeps only the first.
    assert_distribution(draw(SamplingParams(top_k=3, top_p=0.5)), [1, 0, 0, 0])


def test_min_p_is_relative_to_the_top_token():
    # min_p 0.2 -> threshold 0.1: the 0.05 token goes.
    assert_distribution(draw(SamplingParams(min_p=0.2)), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0])
    # min_p 0.5 -> threshold 0.25: only 0.5 and 0.3 stay.
    assert_distribution(draw(SamplingParams(min_p=0.5)), [0.5 / 0.8, 0.3 / 0.8, 0, 0])


def test_filters_mix_per_row():
    logits = LOGITS.expand(3, -1).clone()
    masked_k = apply_top_k_top_p(logits, [1, 0, 0], [1.0, 1.0, 1.0])
    assert torch.isinf(masked_k[0, 1:]).all() and torch.equal(masked_k[1:], logits[1:])
    masked_p = apply_min_p(logits, [0.0, 0.5, 0.0])
    assert torch.isinf(masked_p[1, 2:]).all() and torch.equal(masked_p[[0, 2]], logits[[0, 2]])


def test_seeded_sampling_is_reproducible_regardless_of_batch():
    vocab = 64
    target = torch.randn(vocab, generator=torch.Generator().manual_seed(3))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def sample_steps(batch_size: int, row: int) -> list[int]:
        generator = make_generator(7)
        others = torch.randn(batch_size, vocab)
        out = []
        for _ in range(20):
            logits = others.clone()
            logits[row] = target
            all_params = [SamplingParams(temperature=0.8)] * batch_size
            all_params[row] = params
            gens: list[torch.Generator | None] = [None] * batch_size
            gens[row] = generator
            tokens, _, _ = Sampler().sample(logits, all_params, gens)
            out.append(tokens[row])
        return out

    alone = sample_steps(1, 0)
    assert sample_steps(5, 3) == alone
    assert sample_steps(9, 8) == alone
    assert len(set(alone)) > 1


def test_different_seeds_differ():
    logits = torch.zeros(1, 1000)
    params = [SamplingParams(seed=1)]
    first = [Sampler().sample(logits, params, [make_generator(1)])[0][0] for _ in range(3)]
    second = [Sampler().sample(logits, params, [make_generator(2)])[0][0] for _ in range(3)]
    assert first[0] == first[1] == first[2]
    assert first[0] != second[0]


def test_logprobs_of_chosen_tokens_use_the_raw_logits():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    params = [
        SamplingParams(temperature=0.0, logprobs=True),
        SamplingParams(temperature=0.5, top_k=3),
        SamplingParams(temperature=2.0, logprobs=True),
        SamplingParams(temperature=0.0),
    ]
    tokens, logprobs, _ = Sampler().sample(logits, params, [None] * 4)
    reference = torch.log_softmax(logits, dim=-1)
    expected = reference[torch.arange(4), torch.tensor(tokens)]
    assert [lp.logprob for lp in logprobs] == pytest.approx(expected.tolist())
    assert math.isclose(logprobs[0].logprob, reference[0].max().item(), rel_tol=1e-6)
    # the rank in the vocabulary, as vLLM counts it: the tokens at least as likely
    assert [lp.rank for lp in logprobs] == (reference >= expected[:, None]).sum(dim=-1).tolist()
    assert logprobs[0].rank == logprobs[3].rank == 1  # greedy rows


def test_token_logprobs_rank_a_token_below_the_top_k():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, 2.0]])
    [entry], [top] = token_logprobs(logits, torch.tensor([3]), [2])
    reference = torch.log_softmax(logits[0], dim=-1)
    assert entry == (pytest.approx(reference[3].item()), 5)
    assert top[0][0] == 0 and top[1][0] in {2, 4}  # 2 and 4 tie for second
    [tied], _ = token_logprobs(logits, torch.tensor([2]), [0])
    assert tied.rank == 3  # tied with token 4: both count


def test_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(2, 5), [SamplingParams()], [None, None])


@pytest.mark.parametrize("bad", ["nan", "+inf", "all -inf"])
def test_a_row_without_a_distribution_raises_naming_its_row(bad):
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    logits[:, 5] = float("-inf")  # masked tokens alone are fine
    if bad == "nan":
        logits[2, 7] = float("nan")
    elif bad == "+inf":
        logits[2, 7] = float("inf")
    else:
        logits[2] = float("-inf")
    params = [SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(seed=3), SamplingParams()]
    generators = [None, None, make_generator(3), make_generator(4)]
    states = [g.get_state() for g in generators[2:]]
    with pytest.raises(NonFiniteLogitsError) as failure:
        Sampler().sample(logits, params, generators)
    assert failure.value.rows == [2]
    # Nothing was drawn: a rerun without the bad row samples as if it had never failed.
    assert all(torch.equal(g.get_state(), s) for g, s in zip(generators[2:], states, strict=True))
    tokens, _, _ = Sampler().sample(logits[[0, 1, 3]], [params[i] for i in (0, 1, 3)], [None, None, generators[3]])
    assert 5 not in tokens and tokens[0] == logits[0].argmax().item()


def test_top_logprobs_are_each_rows_k_most_likely_tokens():
    logits = torch.randn(3, 30, generator=torch.Generator().manual_seed(7))
    params = [SamplingParams(temperature=0.0, logprobs=4), SamplingParams(temperature=1.0, logprobs=0),
              SamplingParams(temperature=0.0)]
    tokens, logprobs, top = Sampler().sample(logits, params, [None] * 3)
    reference = torch.log_softmax(logits, dim=-1)
    values, ids = reference[0].topk(4)
    assert [t for t, _ in top[0]] == ids.tolist()
    assert [lp for _, lp in top[0]] == pytest.approx(values.tolist())
    assert top[0][0] == (tokens[0], pytest.approx(logprobs[0].logprob))  # greedy: the top token
    assert top[1] == [] and top[2] == []
