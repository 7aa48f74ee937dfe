"""The rag-blend workload's paired bootstrap interval of blended over full-prefill accuracy."""

from __future__ import annotations

from bench.rag_blend import accuracy_ratio_interval


def test_the_same_answers_give_a_ratio_of_one_with_no_spread():
    full = [True, False, True, True, False] * 4
    assert accuracy_ratio_interval(full, full, seed=0) == (1.0, 1.0)


def test_the_interval_holds_the_point_estimate_and_narrows_with_more_queries():
    # the blend is right on 3 of every 4 queries the full prefill gets, and on no other
    full = [True, True, True, True, False]
    blend = [True, True, True, False, False]
    few = accuracy_ratio_interval(full * 4, blend * 4, seed=0)
    many = accuracy_ratio_interval(full * 40, blend * 40, seed=0)
    for low, high in (few, many):
        assert low < 0.75 < high <= 1.0
    assert many[1] - many[0] < (few[1] - few[0]) / 2


def test_the_spread_comes_from_the_queries_the_two_disagree_on():
    # the same accuracy either way; agreeing on every query leaves no doubt about the ratio,
    # disagreeing on every one leaves much (an unpaired resample would not tell them apart)
    answers = [True, False] * 25
    assert accuracy_ratio_interval(answers, list(answers), seed=3) == (1.0, 1.0)
    low, high = accuracy_ratio_interval(answers, answers[1:] + answers[:1], seed=3)
    assert low < 0.8 and high > 1.25
