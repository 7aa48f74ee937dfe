"""Our model forward against transformers on the same tiny checkpoints (fp32), and the loader."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.models import (
    ModelLoadError,
    UnsupportedArchitectureError,
    load_model,
    resolve_dtype,
)
from engine.models import spec as spec_module
from engine.models.layers import Linear
from engine.random_model import make_model
from kvkernels.metadata import AttentionMetadata

BLOCK_SIZE = 8
NUM_BLOCKS = 12
PROMPT_LEN = 40
ATOL = 1e-4

CASES = {
    "llama": ("llama", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "mistral": ("mistral", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
    ),
    "yarn-rope": (
        "qwen2",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
    ),
}


@pytest.fixture(scope="module")
def checkpoint(tiny_model_factory, tmp_path_factory):
    """checkpoint(case) -> path; dict-valued overrides bypass the (hashing) session cache."""
    built: dict[str, str] = {}

    def get(case: str) -> str:
        architecture, overrides = CASES[case]
        if case not in built:
            if any(isinstance(v, dict) for v in overrides.values()):
                path = str(tmp_path_factory.mktemp(f"ckpt-{case}"))
                built[case] = make_model(
                    path, architecture=architecture, preset="tiny", **overrides
                )
            else:
                built[case] = tiny_model_factory(architecture, **overrides)
        return built[case]

    return get


def make_meta(batch: list[tuple[int, int, list[int]]]) -> AttentionMetadata:
    """Metadata for sequences given as (start position, new tokens, block table)."""
    starts, lens, slots = [0], [], []
    for start, num_new, table in batch:
        starts.append(starts[-1] + num_new)
        lens.append(start + num_new)
        for pos in range(start, start + num_new):
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
    width = max(len(table) for _, _, table in batch)
    tables = [table + [0] * (width - len(table)) for _, _, table in batch]
    return AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_lens_cpu=[n for _, n, _ in batch],
        seq_lens_cpu=lens,
        max_query_len=max(n for _, n, _ in batch),
        max_seq_len=max(lens),
    )


def new_kv_cache(spec) -> torch.Tensor:
    shape = (NUM_BLOCKS, spec.num_layers, 2, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim)
    return torch.zeros(shape)


def run_step(model, kv_cache, prompts, batch) -> list[torch.Tensor]:
    """One forward over `batch` = [(prompt index, start, new tokens, table)]; logits per entry."""
    ids = torch.cat([prompts[i][s : s + n] for i, s, n, _ in batch])
    positions = torch.cat([torch.arange(s, s + n) for _, s, n, _ in batch])
    meta = make_meta([(s, n, table) for _, s, n, table in batch])
    logits = model.compute_logits(model(ids, positions, kv_cache, meta))
    assert logits.dtype == torch.float32
    return list(logits.split([n for _, _, n, _ in batch]))


def prompts_for(vocab_size: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab_size, (PROMPT_LEN,), generator=gen) for _ in range(2)]


@torch.inference_mode()
def reference_logits(path: str, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return [hf(prompt[None]).logits[0] for prompt in prompts]


@pytest.mark.parametrize("case", list(CASES))
@torch.inference_mode()
def test_logits_match_transformers(checkpoint, case):
    path = checkpoint(case)
    model, spec = load_model(path, torch.float32, torch.device("cpu"))
    prompts = prompts_for(spec.vocab_size)
    expected = reference_logits(path, prompts)

    whole = run_step(model, new_kv_cache(spec), prompts, [(0, 0, PROMPT_LEN, [3, 0, 7, 5, 1])])
    torch.testing.assert_close(whole[0], expected[0], atol=ATOL, rtol=0)

    # two sequences share every step: prefill chunks of one next to decodes of the other,
    # each reading its earlier tokens from blocks scattered out of order
    tables = [[9, 2, 7, 0, 4], [1, 8, 3, 11, 5]]
    schedules = [[13, 1, 1, 8, 1, 16], [1, 20, 3, 1, 1, 14]]
    kv_cache, done, outputs = new_kv_cache(spec), [0, 0], [[], []]
    for step in zip(*schedules, strict=True):
        batch = [(i, done[i], n, tables[i]) for i, n in enumerate(step)]
        for i, logits in enumerate(run_step(model, kv_cache, prompts, batch)):
            outputs[i].append(logits)
            done[i] += step[i]
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(torch.cat(got), want, atol=ATOL, rtol=0)


def test_spec_and_digest(checkpoint):
    path = checkpoint("qwen3")
    _, spec = load_model(path, torch.float32, "cpu")
    assert (spec.architecture, spec.model_type) == ("Qwen3ForCausalLM", "qwen3")
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size) == (4, 2, 32, 64)
    assert spec.eos_token_ids == [2] and spec.bos_token_id == 1
    assert spec.torch_dtype == "float32"
    assert len(spec.weights_digest) == 32
    _, again = load_model(path, torch.float32, "cpu")
    _, other = load_model(checkpoint("llama"), torch.float32, "cpu")
    assert again.weights_digest == spec.weights_digest != other.weights_digest


def test_eos_ids_merge_generation_config(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("llama"), tmp_path / "ckpt")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    _, spec = load_model(str(path), torch.float32, "cpu")
    assert spec.eos_token_ids == [7, 2]


@torch.inference_mode()
def test_sharded_checkpoint_loads_identically(checkpoint, tmp_path):
    path = checkpoint("qwen2")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    single, _ = load_model(path, torch.float32, "cpu")
    sharded, _ = load_model(str(tmp_path), torch.float32, "cpu")
    for (name, a), (_, b) in zip(
        single.state_dict().items(), sharded.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name


def test_bf16_forward_runs(checkpoint):
    model, spec = load_model(checkpoint("llama"), torch.bfloat16, "cpu")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    kv = torch.zeros(
        (NUM_BLOCKS, spec.num_layers, 2, BLOCK_SIZE, spec.num_kv_heads, spec.head_dim),
        dtype=torch.bfloat16,
    )
    prompt = prompts_for(spec.vocab_size)[0]
    with torch.inference_mode():
        (logits,) = run_step(model, kv, [prompt], [(0, 0, PROMPT_LEN, [4, 1, 0, 2, 3])])
    assert logits.shape == (PROMPT_LEN, spec.vocab_size) and torch.isfinite(logits).all()


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(), reason="no oneDNN bf16 on this CPU")
@pytest.mark.parametrize("case", ["llama", "llama-tied", "qwen2"])
@torch.inference_mode()
def test_packed_bf16_weights_give_the_plain_logits(checkpoint, case):
    """Packed weights (oneDNN's layout) compute what the plain ones do, up to bf16
    rounding, with biases (qwen2) and a tied head; the plain weights are freed."""
    path = checkpoint(case)
    plain, spec = load_model(path, torch.bfloat16, "cpu")
    packed, _ = load_model(path, torch.bfloat16, "cpu")
    biases = [m.bias for model in (plain, packed) for m in model.modules() if isinstance(m, Linear) and m.bias is not None]
    assert bool(biases) == (case == "qwen2")
    for bias in biases:  # the checkpoint's are zeros
        bias.copy_(torch.linspace(-1, 1, bias.numel()))
    weight_bytes = plain.weight_bytes()
    assert packed.pack_weights()
    assert packed.weight_bytes() == weight_bytes
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.weight is None for m in linears)
    prompt = prompts_for(spec.vocab_size)[0]
    table = [4, 1, 0, 2, 3]
    prefill_and_decode = [[(0, 0, PROMPT_LEN - 1, table)], [(0, PROMPT_LEN - 1, 1, table)]]
    logits = {}
    for name, model in (("plain", plain), ("packed", packed)):
        kv = new_kv_cache(spec).to(torch.bfloat16)
        logits[name] = [run_step(model, kv, [prompt], batch)[0] for batch in prefill_and_decode]
    for got, want in zip(logits["packed"], logits["plain"], strict=True):
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.02)


def test_fp32_weights_stay_plain(checkpoint):
    model, _ = load_model(checkpoint("llama"), torch.float32, "cpu")
    assert not model.pack_weights()
    assert all(m.packed is None and m.weight is not None for m in model.modules() if isinstance(m, Linear))


def test_unsupported_architecture(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("llama"), tmp_path / "ckpt")
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        load_model(str(path), torch.float32, "cpu")


def test_unsupported_rope_type(tmp_path):
    path = make_model(
        str(tmp_path), preset="tiny", rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    )
    with pytest.raises(UnsupportedArchitectureError, match="dynamic"):
        load_model(path, torch.float32, "cpu")


def test_missing_weight(checkpoint, tmp_path):
    path = shutil.copytree(checkpoint("llama"), tmp_path / "ckpt")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"missing model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(path), torch.float32, "cpu")


def test_no_checkpoint(tmp_path):
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_model(str(tmp_path), torch.float32, "cpu")


def test_resolve_dtype(checkpoint, tmp_path):
    path = checkpoint("llama")
    assert resolve_dtype("auto", path) == torch.float32
    assert resolve_dtype("bf16", path) == torch.bfloat16
    assert resolve_dtype("float16", None) == torch.float16
    assert resolve_dtype("auto", {"torch_dtype": "bfloat16"}) == torch.bfloat16
    assert resolve_dtype("auto", {}) == torch.float32
    _, spec = load_model(path, torch.float32, "cpu")
    assert resolve_dtype("auto", spec) == torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", path)


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_on_a_cpu_is_float32_where_half_matmuls_are_emulated(monkeypatch, native):
    monkeypatch.setattr(spec_module, "cpu_has_native_matmul", lambda dtype: native)
    declared = {"torch_dtype": "bfloat16"}
    assert resolve_dtype("auto", declared, "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", {"torch_dtype": "float16"}, torch.device("cpu")) == (
        torch.float16 if native else torch.float32)
    assert resolve_dtype("bfloat16", declared, "cpu") == torch.bfloat16, "an explicit dtype is kept"
    assert resolve_dtype("auto", declared, "meta") == torch.bfloat16, "only a CPU device is probed"


def test_auto_setting_the_declared_dtype_aside_is_logged(tiny_model_factory, monkeypatch, caplog):
    monkeypatch.setattr(spec_module, "cpu_has_native_matmul", lambda dtype: dtype == torch.float32)
    with caplog.at_level(logging.INFO, logger="engine.models.loader"):
        model, _ = load_model(tiny_model_factory("llama", dtype="bfloat16"), "auto", "cpu")
    assert next(model.parameters()).dtype == torch.float32
    assert "float32 rather than the declared bfloat16" in caplog.text and "--dtype bfloat16" in caplog.text


def test_an_auto_dtype_model_on_this_cpu_loads_in_what_it_runs_natively(tiny_model_factory):
    model, _ = load_model(tiny_model_factory("llama", dtype="bfloat16"), "auto", "cpu")
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert next(model.parameters()).dtype == (torch.bfloat16 if native else torch.float32)


def test_sliding_window_limits_context(tiny_model_factory):
    _, spec = load_model(tiny_model_factory("mistral", sliding_window=32), torch.float32, "cpu")
    assert spec.max_position_embeddings == 32
