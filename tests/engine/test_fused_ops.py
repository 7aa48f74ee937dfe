"""The fused elementwise chains of large steps (engine/models/fused.py): the forward that
uses them against transformers (fp32), when they are used, and the eager fallback."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.models import fused, load_model
from kvkernels.metadata import AttentionMetadata

BLOCK_SIZE = 16
LONG = fused.MIN_FUSED_TOKENS + 44
ATOL = 1e-4


class Counting:
    """Wraps a fused op and counts its calls."""

    def __init__(self, op) -> None:
        self.op, self.calls = op, 0

    def __call__(self, *args):
        self.calls += 1
        return self.op(*args)


@pytest.fixture
def counted(monkeypatch):
    ops = {name: Counting(getattr(fused, name)) for name in ("rms_norm", "rotary", "silu_and_mul")}
    for name, op in ops.items():
        monkeypatch.setattr(fused, name, op)
    return ops


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])  # qwen3: q/k norms over heads
@torch.inference_mode()
def test_a_fused_forward_matches_transformers(tiny_model_factory, counted, architecture):
    path = tiny_model_factory(architecture)
    model, spec = load_model(path, torch.float32, torch.device("cpu"))
    model.fuse_large_steps()
    warm_up = {name: op.calls for name, op in counted.items()}
    prompt = torch.randint(3, spec.vocab_size, (LONG,), generator=torch.Generator().manual_seed(3))
    kv_cache = torch.zeros(-(-LONG // BLOCK_SIZE), spec.num_layers, 2, BLOCK_SIZE, spec.num_kv_heads,
                           spec.head_dim)
    logits = model.compute_logits(model(prompt, torch.arange(LONG), kv_cache, AttentionMetadata.one_prefill(LONG, BLOCK_SIZE)))
    expected = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(prompt[None]).logits[0]
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=0)
    per_layer_norms = 2 + 2 * (architecture == "qwen3")
    calls = {name: op.calls - warm_up[name] for name, op in counted.items()}
    assert calls == {"rms_norm": spec.num_layers * per_layer_norms + 1, "rotary": spec.num_layers,
                     "silu_and_mul": spec.num_layers}


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
@torch.inference_mode()
def test_the_first_large_step_compiles_nothing_after_the_warm_up(tiny_model_factory, architecture):
    path = tiny_model_factory(architecture)
    model, spec = load_model(path, torch.float32, torch.device("cpu"))
    torch._dynamo.reset()  # forget what earlier tests compiled: the warm-up alone must cover a step
    model.fuse_large_steps()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs > 0
    prompt = torch.randint(3, spec.vocab_size, (2 * LONG,), generator=torch.Generator().manual_seed(4))
    kv_cache = torch.zeros(-(-2 * LONG // BLOCK_SIZE), spec.num_layers, 2, BLOCK_SIZE, spec.num_kv_heads,
                           spec.head_dim)
    model(prompt, torch.arange(2 * LONG), kv_cache, AttentionMetadata.one_prefill(2 * LONG, BLOCK_SIZE))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs


def test_small_steps_and_unfused_engines_run_eager(tiny_model_factory, counted):
    path = tiny_model_factory("llama")
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    prompt = list(range(3, 3 + LONG))
    with LLM(model=path, dtype="float32", fuse_elementwise=False) as plain:
        expected = plain.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert sum(op.calls for op in counted.values()) == 0
    with LLM(model=path, dtype="float32") as llm:
        warm_up = {name: op.calls for name, op in counted.items()}
        llm.generate([prompt[:40]], greedy, use_tqdm=False)  # a 40-token prefill and decodes
        assert {name: op.calls for name, op in counted.items()} == warm_up
        tokens = llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0].token_ids
    assert counted["silu_and_mul"].calls > warm_up["silu_and_mul"]
    assert tokens == expected


def test_an_op_that_fails_to_compile_runs_eager_from_then_on(monkeypatch, caplog):
    compiles = []

    def broken_compile(fn, **options):
        compiles.append(fn)

        def raises(*args):
            raise RuntimeError("no C++ compiler")

        return raises

    monkeypatch.setattr(torch, "compile", broken_compile)
    op = fused._Fused(lambda x: x * 2)
    x = torch.arange(4.0)
    assert torch.equal(op(x), x * 2)
    assert op.failed and "no C++ compiler" in caplog.text
    assert torch.equal(op(x + 1), (x + 1) * 2)
    assert len(compiles) == 1
