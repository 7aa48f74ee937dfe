"""--kv-offload-eviction reaches the cpu and disk tiers an engine builds (their behaviour
under each policy: tests/store/test_eviction.py)."""

from __future__ import annotations

import pytest

from engine.arg_utils import load_options
from engine.cli import build_parser
from engine.config import ConfigError, EngineConfig, ServerConfig
from engine.llm_engine import LLMEngine


@pytest.mark.parametrize(("argv", "policy"), [((), "lru"), (("--kv-offload-eviction", "arc"), "arc")])
def test_the_flag_reaches_the_cpu_and_disk_tiers(tiny_model_factory, tmp_path, argv, policy):
    args = build_parser().parse_args([
        "serve", "--model", tiny_model_factory(), "--kv-offload", "cpu,disk", "--kv-offload-cpu-size", "8MiB",
        "--kv-offload-disk-path", str(tmp_path / "disk"), "--num-kv-blocks", "32", "--no-fuse-elementwise", *argv,
    ])
    config, _ = load_options(args, EngineConfig, ServerConfig)
    engine = LLMEngine(config)
    try:
        store = engine.connector.store
        tiers = {tier.name: tier for tier in store.tiers}
        assert set(tiers) == {"cpu", "disk"}
        for tier in tiers.values():
            assert tier.eviction == policy
    finally:
        engine.shutdown()


def test_an_unknown_policy_names_the_option():
    with pytest.raises(ConfigError, match=r"^--kv-offload-eviction: Input should be 'lru' or 'arc', got 'lfu'"):
        EngineConfig(kv_offload="cpu", kv_offload_eviction="lfu")
