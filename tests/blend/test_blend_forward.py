"""The blended forward on tiny random models (fp32, 4 layers, so that layers after the
check layer exist): with nothing reused it is a full prefill (transformers' logits);
moved keys equal keys computed at the new position; the tokens recomputed are those the
question attends to most, with their neighbours, or without a question those whose stored
KV deviates most; a segment's common error, learnt from a sample of its tokens, is taken
off the tokens that keep their moved KV."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.blend import forward
from engine.blend.forward import BlendPlan, ShiftRotary, blend_prefill
from engine.model_runner import allocate_kv_cache
from engine.models import load_model

BLOCK_SIZE = 4
LAYERS = 4


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tiny_model_factory) -> str:
    return tiny_model_factory(request.param, num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def model(checkpoint):
    loaded, _spec = load_model(checkpoint, "float32", torch.device("cpu"))
    return loaded


class Scratch:
    """A private paged cache and a bump allocator of its slots."""

    def __init__(self, model) -> None:
        args = model.args
        self.cache = allocate_kv_cache(256, args.num_layers, BLOCK_SIZE, args.num_kv_heads, args.head_dim,
                                       torch.float32, torch.device("cpu"))
        self.next = 0
        self.rotary = ShiftRotary(model)
        self.model = model

    def slots(self, n: int) -> torch.Tensor:
        out = torch.arange(self.next, self.next + n)
        self.next += n
        return out

    def run(self, tokens, positions, context=None, reuse=None, shift=None, ratio=1.0):
        n = len(tokens)
        plan = BlendPlan(
            token_ids=torch.tensor(tokens), positions_cpu=torch.tensor(positions),
            context_slots=context if context is not None else torch.empty(0, dtype=torch.long),
            dest_slots=self.slots(n),
            reuse_slots=reuse if reuse is not None else torch.full((n,), -1),
            reuse_shift=shift if shift is not None else torch.zeros(n, dtype=torch.long),
            recompute_ratio=ratio,
        )
        with torch.inference_mode():
            return plan, blend_prefill(self.model, self.cache, plan, self.rotary)

    def kv(self, slots: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE
        return self.cache[blocks, layer, 0, offsets], self.cache[blocks, layer, 1, offsets]


def prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 250, (n,), generator=g).tolist()


def test_without_reuse_it_is_a_full_prefill(checkpoint, model):
    tokens = prompt(40)
    scratch = Scratch(model)
    _, result = scratch.run(tokens, range(40))
    logits = model.compute_logits(result.hidden[-1:])
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0, -1:]
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    assert result.rows.tolist() == list(range(40)) and result.num_reused == 0


def test_context_slots_continue_a_prefix(model):
    """The region after 20 tokens of context equals the same tokens of a whole prefill."""
    tokens = prompt(40, seed=1)
    scratch = Scratch(model)
    whole, full = scratch.run(tokens, range(40))
    _, tail = scratch.run(tokens[20:], range(20, 40), context=whole.dest_slots[:20])
    torch.testing.assert_close(tail.hidden, full.hidden[20:], atol=1e-5, rtol=1e-5)


def test_a_moved_segment_equals_the_segment_computed_at_its_new_position(model):
    segment, shift = prompt(24, seed=2), 37
    scratch = Scratch(model)
    at_zero, _ = scratch.run(segment, range(24))
    at_shift, _ = scratch.run(segment, range(shift, shift + 24))
    moved, result = scratch.run(segment, range(shift, shift + 24), reuse=at_zero.dest_slots,
                                shift=torch.full((24,), shift), ratio=0.0)
    assert result.num_reused == 24 and len(result.rows) == 0
    for layer in range(LAYERS):
        expected_k, expected_v = scratch.kv(at_shift.dest_slots, layer)
        k, v = scratch.kv(moved.dest_slots, layer)
        torch.testing.assert_close(k, expected_k, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v, expected_v, atol=1e-5, rtol=1e-5)
        if layer > 1:  # past the check layer the stored KV itself is used, only rotated
            stored_k, stored_v = scratch.kv(at_zero.dest_slots, layer)
            assert torch.equal(v, stored_v)
            torch.testing.assert_close(scratch.rotary.rotate(stored_k, torch.full((24,), shift)), k)


def exact_copy(scratch: Scratch, slots: torch.Tensor) -> torch.Tensor:
    """New slots holding the KV of `slots`, every layer."""
    copy = scratch.slots(len(slots))
    scratch.cache[copy // BLOCK_SIZE, :, :, copy % BLOCK_SIZE] = \
        scratch.cache[slots // BLOCK_SIZE, :, :, slots % BLOCK_SIZE]
    return copy


def test_without_question_tokens_the_check_layer_keeps_the_tokens_whose_stored_kv_deviates_most(model):
    """Every token reused, the stored KV equal to the in-context KV except at two tokens
    of layers 1 and 2: a ratio that recomputes two tokens recomputes exactly those, with
    the full prefill's hidden states."""
    tokens = prompt(32, seed=3)
    scratch = Scratch(model)
    whole, full = scratch.run(tokens, range(32))
    stored = exact_copy(scratch, whole.dest_slots)
    bad = torch.tensor([5, 21])
    for layer in (1, 2):
        scratch.cache[stored[bad] // BLOCK_SIZE, layer, 1, stored[bad] % BLOCK_SIZE] += 3.0
    _, result = scratch.run(tokens, range(32), reuse=stored, shift=torch.zeros(32, dtype=torch.long), ratio=2 / 32)
    assert result.rows.tolist() == [5, 21]
    torch.testing.assert_close(result.hidden, full.hidden[bad], atol=1e-5, rtol=1e-5)


def question_weights(checkpoint: str, tokens: list[int], question: int) -> torch.Tensor:
    """Per token before the last `question` ones: the largest attention weight any head
    of any question row pays it after the check layer in a full prefill (transformers'
    eager attention)."""
    reference = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        attentions = reference.eval()(torch.tensor([tokens]), output_attentions=True).attentions
    first = len(tokens) - question
    return torch.stack([a[0, :, first:, :first].amax((0, 1)) for a in attentions[2:]]).amax(0)


def ranked_with_neighbours(weights: torch.Tensor, segments: list[range], count: int) -> list[int]:
    """The `count` tokens of the highest largest weight within 2 tokens of them in their
    own segment, ties to the higher weight of their own."""
    def key(i: int) -> tuple[float, float]:
        segment = next(s for s in segments if i in s)
        near = [weights[j] for j in range(i - 2, i + 3) if j in segment]
        return float(max(near)), float(weights[i])
    return sorted(sorted(range(len(weights)), key=key, reverse=True)[:count])


def test_the_question_recomputes_the_tokens_it_and_their_neighbours_attend_to_most(checkpoint, model):
    """Two segments of 14 tokens, the last 4 tokens computed (the question), the others'
    stored KV exact: the 5 tokens recomputed are those with the largest attention weight
    from the question, in a full prefill, on themselves or a neighbour within 2 tokens of
    their own segment; the question's hidden states are the full prefill's."""
    tokens = prompt(32, seed=5)
    scratch = Scratch(model)
    whole, full = scratch.run(tokens, range(32))
    reuse = exact_copy(scratch, whole.dest_slots)
    second = reuse[14:28]  # stored as computed from position 0, moved back by 14 (what tells segments apart)
    blocks, offsets = second // BLOCK_SIZE, second % BLOCK_SIZE
    for layer in range(LAYERS):
        keys = scratch.cache[blocks, layer, 0, offsets]
        scratch.cache[blocks, layer, 0, offsets] = scratch.rotary.rotate(keys, torch.full((14,), -14))
    reuse[28:] = -1
    shift = torch.tensor([0] * 14 + [14] * 18)
    _, result = scratch.run(tokens, range(32), reuse=reuse, shift=shift, ratio=5 / 28)
    weights = question_weights(checkpoint, tokens, 4)
    expected = ranked_with_neighbours(weights, [range(0, 14), range(14, 28)], 5)
    assert result.rows.tolist() == [*expected, 28, 29, 30, 31]
    top = int(weights.argmax())
    assert any(abs(row - top) in (1, 2) for row in expected)  # a neighbour came with the top token
    torch.testing.assert_close(result.hidden[-4:], full.hidden[-4:], atol=1e-5, rtol=1e-5)


def test_ratio_one_recomputes_everything_whatever_is_stored(model):
    tokens = prompt(32, seed=4)
    scratch = Scratch(model)
    _, full = scratch.run(tokens, range(32))
    junk = scratch.slots(32)  # never written: zeros, as far from the real KV as it gets
    _, result = scratch.run(tokens, range(32), reuse=junk, shift=torch.zeros(32, dtype=torch.long), ratio=1.0)
    assert result.num_reused == 0
    torch.testing.assert_close(result.hidden, full.hidden, atol=1e-6, rtol=1e-6)


def test_a_segments_common_error_is_learnt_from_its_sample_and_taken_off_its_other_tokens(model, monkeypatch):
    """Two segments of 40 tokens stored with their exact KV plus an error of their own,
    the same for every token of the segment after the check layer (values as they are,
    keys before rotation), then 8 question tokens. At ratio 0.15 the budget (12 tokens)
    affords the sample (offset 16 of each segment): the sampled tokens are recomputed, the
    error is learnt from them and taken off the others, and the blend is the full prefill.
    Without the sample the error stays."""
    tokens = prompt(88, seed=6)
    scratch = Scratch(model)
    whole, full = scratch.run(tokens, range(88))
    reuse = exact_copy(scratch, whole.dest_slots)
    reuse[80:] = -1
    shift = torch.tensor([0] * 40 + [40] * 48)
    offsets = torch.arange(80) % 40
    g = torch.Generator().manual_seed(7)
    blocks, slots = reuse[:80] // BLOCK_SIZE, reuse[:80] % BLOCK_SIZE
    for layer in range(LAYERS):
        keys = scratch.cache[blocks, layer, 0, slots]
        stored = scratch.rotary.rotate(keys, -shift[:80])  # the second segment as computed from position 0
        if layer > 1:
            shape = (2, *keys.shape[1:])
            key_error, value_error = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
            segment = torch.arange(80) // 40
            stored += scratch.rotary.rotate(key_error[segment], offsets)
            scratch.cache[blocks, layer, 1, slots] += value_error[segment]
        scratch.cache[blocks, layer, 0, slots] = stored
    plan, result = scratch.run(tokens, range(88), reuse=reuse, shift=shift, ratio=0.15)
    assert len(result.rows) == 12 + 8 and {16, 56} <= set(result.rows.tolist())
    torch.testing.assert_close(result.hidden, full.hidden[result.rows], atol=1e-4, rtol=1e-4)
    for layer in range(LAYERS):
        torch.testing.assert_close(scratch.kv(plan.dest_slots, layer), scratch.kv(whole.dest_slots, layer),
                                   atol=1e-4, rtol=1e-4)

    monkeypatch.setattr(forward, "SAMPLE_BUDGET_SHARE", 7)  # 2 sampled tokens need 14 > 12
    _, unsampled = scratch.run(tokens, range(88), reuse=reuse, shift=shift, ratio=0.15)
    assert len(unsampled.rows) == 12 + 8
    assert not torch.allclose(unsampled.hidden[-8:], full.hidden[-8:], atol=1e-2, rtol=1e-2)
