"""Segmented requests through the engine (tiny random model, fp32, 4 layers): segment
prefills, reuse in any order, blended blocks kept apart from exact ones, aborts,
failures, and the fall-backs to an ordinary request."""

from __future__ import annotations

import random

import pytest

import engine.model_runner as model_runner
from engine import LLM, SamplingParams, Segments
from engine.cli import main
from engine.config import ConfigError

GREEDY = SamplingParams(max_tokens=6, temperature=0)


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory) -> str:
    return tiny_model_factory(num_hidden_layers=4)


def make_llm(checkpoint: str, **options) -> LLM:
    return LLM(model=checkpoint, dtype="float32", num_kv_blocks=options.pop("num_kv_blocks", 256), **options)


class Corpus:
    """A system prompt, documents and questions of random token ids."""

    def __init__(self, seed: int = 0) -> None:
        rng = random.Random(seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, 250) for _ in range(n)]

        self.system = tokens(20)
        self.docs = [tokens(n) for n in (50, 37, 64, 45)]
        self.questions = [tokens(7) for _ in range(4)]

    def segments(self, order: list[int], question: int = 0) -> Segments:
        return Segments([self.system, *(self.docs[d] for d in order), self.questions[question]])

    def plain(self, order: list[int], question: int = 0) -> list[int]:
        return [t for part in self.segments(order, question).parts for t in part]


def generate(llm: LLM, prompt, params: SamplingParams = GREEDY):
    return llm.generate([prompt], params, use_tqdm=False)[0]


def blend_stats(llm: LLM) -> dict[str, int]:
    return {k: v for k, v in llm.stats().items() if k.startswith("kv_blend_")}


def test_ratio_one_equals_the_plain_prompt(checkpoint):
    corpus = Corpus()
    with make_llm(checkpoint, kv_blend_recompute_ratio=1.0) as llm:
        blended = generate(llm, corpus.segments([0, 1, 2]))
        stats = blend_stats(llm)
    with make_llm(checkpoint) as reference:
        plain = generate(reference, corpus.plain([0, 1, 2]))
    assert blended.outputs[0].token_ids == plain.outputs[0].token_ids
    assert blended.prompt_token_ids == plain.prompt_token_ids
    assert stats["kv_blend_requests"] == 1 and stats["kv_blend_segment_prefills"] == 4
    assert stats["kv_blend_reused_tokens"] == 0


def test_documents_stored_in_one_order_are_reused_in_another(checkpoint):
    corpus = Corpus()
    with make_llm(checkpoint) as llm:
        generate(llm, corpus.segments([0, 1, 2]))
        first = blend_stats(llm)
        again = generate(llm, corpus.segments([2, 0, 1], question=1))
        second = blend_stats(llm)
    with make_llm(checkpoint) as fresh:  # the same prompt, nothing stored before
        expected = generate(fresh, corpus.segments([2, 0, 1], question=1))
    assert first["kv_blend_segment_prefills"] == 4  # the system prompt and three documents
    assert second["kv_blend_segment_prefills"] == 4  # nothing new to compute
    reused = second["kv_blend_reused_tokens"] - first["kv_blend_reused_tokens"]
    assert reused > 0 and second["kv_blend_reused_tokens_device"] - first["kv_blend_reused_tokens_device"] == reused
    assert first["kv_blend_reused_tokens_computed"] == first["kv_blend_reused_tokens"] > 0
    # the blend of a prompt does not depend on whether its documents were stored before
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
    assert again.metrics.num_cached_tokens >= reused


def test_requests_sharing_documents_share_their_segment_prefills(checkpoint):
    corpus = Corpus()
    with make_llm(checkpoint) as llm:
        outputs = llm.generate([corpus.segments([0, 1]), corpus.segments([1, 0], 1), corpus.segments([1, 2], 2)],
                               GREEDY, use_tqdm=False)
        stats = blend_stats(llm)
    assert all(o.finished and o.error is None for o in outputs)
    assert stats["kv_blend_segment_prefills"] == 4 and stats["kv_blend_requests"] == 3


def test_blended_blocks_never_serve_a_plain_request(checkpoint):
    corpus = Corpus()
    prompt = corpus.plain([0, 1, 2])
    with make_llm(checkpoint) as llm:
        generate(llm, corpus.segments([0, 1, 2]))
        plain = generate(llm, prompt)
    with make_llm(checkpoint) as fresh:
        expected = generate(fresh, prompt)
    assert plain.outputs[0].token_ids == expected.outputs[0].token_ids
    assert plain.metrics.num_cached_tokens == 16  # the system prompt's full block, exact either way


def test_the_same_blended_request_again_hits_its_own_blocks(checkpoint):
    corpus = Corpus()
    with make_llm(checkpoint) as llm:
        first = generate(llm, corpus.segments([3, 1, 2]))
        before = blend_stats(llm)
        second = generate(llm, corpus.segments([3, 1, 2]))
        after = blend_stats(llm)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    prompt_blocks = (len(first.prompt_token_ids) - 1) // 16 * 16
    assert after["kv_blend_prefix_hit_tokens"] - before["kv_blend_prefix_hit_tokens"] == prompt_blocks
    assert after["kv_blend_segment_prefills"] == before["kv_blend_segment_prefills"]


def test_a_text_prompt_is_split_at_the_configured_separator(checkpoint):
    with make_llm(checkpoint, kv_blend_separator="<|seg|>") as llm:
        tokenizer = llm.tokenizer
        blended = generate(llm, "The system prompt. <|seg|>A first document about cats.<|seg|>Which animal?")
        stats = blend_stats(llm)
        plain = llm.engine.encode("The system prompt. ")
        plain += tokenizer.encode("A first document about cats.", add_special_tokens=False)
        plain += tokenizer.encode("Which animal?", add_special_tokens=False)
    assert blended.prompt_token_ids == plain
    assert stats["kv_blend_requests"] == 1


def test_aborting_a_waiting_request_aborts_its_segment_prefills(checkpoint):
    corpus = Corpus()
    with make_llm(checkpoint) as llm:
        engine = llm.engine
        engine.add_request("r1", corpus.segments([0, 1]), GREEDY)
        assert engine.scheduler.num_waiting == 3
        engine.abort_request(["r1"])
        assert not engine.has_unfinished_requests()
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks


def test_a_failing_blend_fails_its_request_alone(checkpoint, monkeypatch):
    corpus = Corpus()
    real = model_runner.blend_prefill
    calls = []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(model_runner, "blend_prefill", fails_once)
    with make_llm(checkpoint) as llm:
        outputs = llm.generate([corpus.segments([0, 1]), corpus.segments([1, 0], 1), corpus.plain([2])],
                               GREEDY, use_tqdm=False)
        engine = llm.engine
        assert engine.kv_cache_manager.num_free_blocks == engine.num_kv_blocks
    assert outputs[0].error == "RuntimeError: injected" and outputs[0].outputs[0].finish_reason == "error"
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == GREEDY.max_tokens
    assert outputs[2].error is None


@pytest.mark.parametrize("options", [{"enable_prefix_caching": False}, {"num_kv_blocks": 16}])
def test_without_room_for_segments_a_request_runs_as_plain(checkpoint, options):
    """No prefix cache to hold segments, or a pool too small for the segments beside the
    request's own blocks: the request runs as the plain prompt."""
    corpus = Corpus()
    with make_llm(checkpoint, **options) as llm:
        blended = generate(llm, corpus.segments([0, 2, 1]))
        stats = blend_stats(llm)
    with make_llm(checkpoint) as reference:
        plain = generate(reference, corpus.plain([0, 2, 1]))
    assert blended.outputs[0].token_ids == plain.outputs[0].token_ids
    assert stats["kv_blend_requests"] == 0


@pytest.mark.parametrize(("argv", "flag"), [
    (["--kv-blend-recompute-ratio", "1.5"], "--kv-blend-recompute-ratio"),
    (["--kv-blend-recompute-ratio", "-0.1"], "--kv-blend-recompute-ratio"),
    (["--kv-blend-recompute-ratio", "lots"], "--kv-blend-recompute-ratio"),
    (["--kv-blend-separator", ""], "--kv-blend-separator"),
])
def test_bad_blend_options_are_one_line_naming_the_flag(argv, flag, capsys):
    for command in (["generate", "--prompt", "hi"], ["serve"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*command, "--model", "builtin:tiny", *argv])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and flag in err, err


def test_a_ratio_out_of_range_is_refused_by_the_offline_api(checkpoint):
    with pytest.raises(ConfigError, match="kv_blend_recompute_ratio"):  # LLM(...) names the keyword
        make_llm(checkpoint, kv_blend_recompute_ratio=1.01)


def test_a_segmented_request_with_n_above_one_runs_as_the_plain_prompt(checkpoint):
    """n > 1 shares one prefill among its sequences, which a blend does not do."""
    corpus = Corpus()
    params = SamplingParams(max_tokens=6, temperature=0, n=2)
    with make_llm(checkpoint) as llm:
        out = generate(llm, corpus.segments([1, 0, 2]), params)
        stats = blend_stats(llm)
        plain = generate(llm, corpus.plain([1, 0, 2]))
    assert stats["kv_blend_requests"] == 0
    assert [c.token_ids for c in out.outputs] == [plain.outputs[0].token_ids] * 2
