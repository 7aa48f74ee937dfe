"""Checkpoints with the same weights and another config share a disk directory and a
Redis server: each still gets its own cold greedy output (issue 44, item 1).

The store's keys and record headers carry the model fingerprint; before the config
entered it, a checkpoint whose config.json differed only in `rope_theta` (or
`rms_norm_eps`, or a YaRN override) had the same fingerprint as the original and loaded
the original's KV from the shared tiers: a wrong output with every check passing."""

from __future__ import annotations

from pathlib import Path

import pytest
from offload_workloads import CHUNK, counters, delta, one_by_one, random_prompts

from engine import LLM

PROMPTS = random_prompts([150, 97], vocab_size=480, seed=44)
MAX_TOKENS = 8
BASE = {"dtype": "float32", "fuse_elementwise": False, "kv_chunk_tokens": CHUNK}
CONFIG_CHANGES = {
    "rope_theta": {"rope_theta": 50.0},
    "rms_norm_eps": {"rms_norm_eps": 0.5},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
}


def run(model: str, **options) -> tuple[list[list[int]], dict[str, float], LLM]:
    """Greedy outputs of PROMPTS one by one, the stats they moved, and the (closed) LLM."""
    with LLM(model=model, **BASE, **options) as llm:
        before = counters(llm)
        outputs = one_by_one(llm, PROMPTS, MAX_TOKENS)
        moved = delta(before, counters(llm))
    return outputs, moved, llm


@pytest.mark.parametrize("change", list(CONFIG_CHANGES))
def test_a_checkpoint_with_another_config_never_loads_the_others_kv(
    change: str, tiny_llama: str, tiny_model_factory, tmp_path: Path, redis_url: str
):
    other = tiny_model_factory("llama", **CONFIG_CHANGES[change])
    cold, _, plain = run(other)
    original_cold, _, original = run(tiny_llama)
    assert plain.engine.spec.weights_digest == original.engine.spec.weights_digest
    assert cold != original_cold  # else a wrong load could not show
    disk = {"kv_offload_disk_path": str(tmp_path / "shared-disk")}
    redis = {"kv_redis_url": redis_url}

    _, saved, _ = run(tiny_llama, kv_offload="cpu,disk,redis", kv_offload_cpu_size="64MiB", **disk, **redis)
    assert saved["kv_saved_chunks"] > 0
    served = {tier: run(other, kv_offload=tier, **options) for tier, options in (("disk", disk), ("redis", redis))}
    assert {tier: outputs for tier, (outputs, _, _) in served.items()} == {"disk": cold, "redis": cold}
    assert [moved["kv_loaded_tokens"] for _, moved, _ in served.values()] == [0, 0]
    assert served["redis"][2].engine.fingerprint.digest != original.engine.fingerprint.digest
