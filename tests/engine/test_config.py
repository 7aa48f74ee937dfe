"""The config tree: flags generated from it, sizes, the YAML config file, precedence,
vLLM's aliases, and errors that name the flag (CLI) or the keyword (LLM(...))."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from engine.arg_utils import add_config_arguments, config_from_args, load_options
from engine.cli import build_parser
from engine.config import (
    ADMIN_TOKEN_ENV,
    ConfigError,
    EngineConfig,
    GiB,
    ServerConfig,
    StoreOptions,
    flag_name,
)
from kvstore import StoreConfig
from kvstore.options import parse_size

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI_TIMEOUT_S = 540  # under pytest's --timeout=600
MiB = 1024**2


def parse(*argv: str, command: str = "serve") -> argparse.Namespace:
    return build_parser().parse_args([command, *argv])


def serve_options(*argv: str) -> tuple[EngineConfig, ServerConfig]:
    engine, server = load_options(parse(*argv), EngineConfig, ServerConfig)
    return engine, server


def test_every_option_of_the_tree_is_a_flag_with_help():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for name, field in {**EngineConfig.model_fields, **ServerConfig.model_fields}.items():
        assert flag_name(name) in help_text, name
        assert field.description, name
    assert "--config FILE.yaml" in help_text


def test_the_store_section_is_the_stores_own_config():
    """Every store option is declared once, by the store: the engine's section is a
    StoreConfig, with the store's fields, defaults and help, so the engine's config is
    what the store takes."""
    assert issubclass(StoreOptions, StoreConfig)
    for name, field in StoreConfig.model_fields.items():
        included = StoreOptions.model_fields[name]
        assert (included.default, included.description) == (field.default, field.description), name
    config, _ = serve_options(
        "--kv-offload", "cpu,disk,redis", "--kv-redis-url", "redis://127.0.0.1:1", "--kv-redis-ttl", "60",
        "--kv-offload-disk-fsync", "file", "--kv-lookup-timeout", "0.5", "--kv-write-workers", "3",
        "--no-kv-promote", "--kv-max-pending-writes", "64MiB", "--kv-redis-key-prefix", "t:",
    )
    store = StoreConfig(**config.model_dump(include=set(StoreConfig.model_fields)))
    assert (store.kv_redis_ttl, store.kv_offload_disk_fsync, store.kv_lookup_timeout) == (60.0, "file", 0.5)
    assert (store.kv_write_workers, store.kv_promote, store.kv_max_pending_writes) == (3, False, 64 * MiB)
    assert store.kv_redis_key_prefix == "t:" and store.kv_offload == ("cpu", "disk", "redis")


@pytest.mark.parametrize(("text", "expected"), [
    ("4", 4 * GiB), (4, 4 * GiB), (0.5, GiB // 2), ("1.5", 3 * GiB // 2), ("512MiB", 512 * MiB),
    ("2GB", 2 * 10**9), ("1048576B", MiB), ("64 KiB", 64 * 1024), ("0", 0), ("4Gi", 4 * GiB), ("1.GiB", GiB),
])
def test_sizes_bare_numbers_are_gib_units_are_explicit(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["lots", "4 parsecs", "-1", True, "1048576", "1GiB and more", "1e3B"])
def test_bad_sizes_are_refused(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_a_byte_count_without_its_unit_is_refused_with_the_fix():
    with pytest.raises(ConfigError, match=r"^--kv-offload-cpu-size: .* write bytes as 4294967296B"):
        EngineConfig(kv_offload_cpu_size=4294967296)


def test_flags_give_gib_by_default():
    config, _ = serve_options("--kv-offload", "cpu", "--kv-offload-cpu-size", "2", "--kv-cache-memory", "0.25")
    assert config.kv_offload_cpu_size == 2 * GiB and config.kv_cache_memory == GiB // 4


def test_vllm_offloading_aliases():
    config, _ = serve_options("--kv-offloading-size", "3")
    assert config.kv_offload == ("cpu",) and config.kv_offload_cpu_size == 3 * GiB
    config, _ = serve_options("--kv-offloading-backend", "native", "--kv-offload", "disk")
    assert config.kv_offload == ("cpu", "disk")
    assert config.kv_offload_cpu_size == StoreConfig.model_fields["kv_offload_cpu_size"].default
    with pytest.raises(ConfigError, match=r"^--kv-offloading-backend"):
        serve_options("--kv-offloading-backend", "lmcache")
    with pytest.raises(ConfigError, match=r"^--kv-offloading-size: give it or --kv-offload-cpu-size"):
        serve_options("--kv-offloading-size", "3", "--kv-offload-cpu-size", "1")
    # folded in: the config rebuilt from its own values is the same config
    assert EngineConfig(**config.model_dump()) == config


def write_yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return str(path)


def test_config_file_keys_are_flag_names_with_or_without_dashes(tmp_path):
    path = write_yaml(tmp_path, (
        "max-num-seqs: 8\nmax_num_batched_tokens: 512\n--block-size: 32\nkv-offload: [cpu, disk]\n"
        "kv-offload-cpu-size: 1\nkv-offload-disk-size: 512MiB\nenable-prefix-caching: false\n"
        "port: 9000\nserved-model-name: [a, b]\n"
    ))
    config, server = serve_options("--config", path)
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.block_size) == (8, 512, 32)
    assert config.kv_offload == ("cpu", "disk") and config.kv_offload_cpu_size == GiB
    assert config.kv_offload_disk_size == 512 * MiB and config.enable_prefix_caching is False
    assert server.port == 9000 and server.served_model_name == ("a", "b")


def test_precedence_flag_over_file_over_env_over_default(tmp_path, monkeypatch):
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "e" * 16)
    _, server = serve_options()
    assert server.admin_token == "e" * 16  # env over default
    path = write_yaml(tmp_path, f"admin-token: {'f' * 16}\nmax-num-seqs: 8\nport: 9000\n")
    config, server = serve_options("--config", path, "--max-num-seqs", "4")
    assert server.admin_token == "f" * 16  # file over env
    assert config.max_num_seqs == 4 and server.port == 9000  # flag over file; file over default
    _, server = serve_options("--config", path, "--admin-token", "g" * 16)
    assert server.admin_token == "g" * 16  # flag over file


def test_vllm_api_options_are_tree_fields_in_every_spelling(tmp_path, monkeypatch):
    for name in ("KVTIER_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    path = write_yaml(tmp_path, f"model: builtin:tiny\nchat-template: {template}\nmax-logprobs: 7\napi-key: sk-file\n")
    config, server = serve_options("--config", path)
    assert config.model == "builtin:tiny" and config.chat_template == template.read_text()  # read once
    assert config.max_logprobs == 7 and server.api_key == "sk-file"
    assert "sk-file" not in repr(server)
    config, _ = serve_options("builtin:random", "--config", path, "--max-logprobs", "2")
    assert config.model == "builtin:random" and config.max_logprobs == 2  # MODEL is a flag: over the file
    with pytest.raises(ConfigError, match=r"^--model: the model is given twice, as MODEL 'builtin:random'"):
        serve_options("builtin:random", "--model", "builtin:tiny")
    assert EngineConfig().max_logprobs == 20 and serve_options()[1].api_key is None


def test_a_chat_template_too_long_for_a_file_name_is_the_template():
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}" * 8
    config = EngineConfig(chat_template=template)
    assert config.chat_template == template
    assert EngineConfig(**config.model_dump()).chat_template == template  # a dump rebuilds the same


def test_the_api_key_comes_from_kvtier_api_key_else_vllm_api_key(monkeypatch):
    monkeypatch.delenv("KVTIER_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "sk-vllm")
    assert serve_options()[1].api_key == "sk-vllm"
    monkeypatch.setenv("KVTIER_API_KEY", "sk-kvtier")
    assert serve_options()[1].api_key == "sk-kvtier"
    assert serve_options("--api-key", "sk-flag")[1].api_key == "sk-flag"


def test_config_file_errors_name_the_key_and_the_file(tmp_path):
    path = write_yaml(tmp_path, "kv-offload-cpu-size: lots\n")
    with pytest.raises(ConfigError, match=r"^--kv-offload-cpu-size: cannot parse size 'lots'.*\(set in .*kvtier.yaml\)"):
        serve_options("--config", path)
    with pytest.raises(ConfigError, match=r"^--config: .*'max_tokens' is not an option"):
        serve_options("--config", write_yaml(tmp_path, "max-tokens: 3\n"))
    with pytest.raises(ConfigError, match=r"^--config: .* must hold a mapping"):
        serve_options("--config", write_yaml(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match=r"^--config: cannot read"):
        serve_options("--config", str(tmp_path / "missing.yaml"))


def test_generate_takes_engine_options_only_from_the_file(tmp_path):
    path = write_yaml(tmp_path, "port: 9000\n")
    with pytest.raises(ConfigError, match="'port' is not an option"):
        config_from_args(parse("--prompt", "x", "--config", path, command="generate"))


def test_llm_keyword_errors_name_the_keyword():
    from engine import LLM

    with pytest.raises(ConfigError, match=r"^kv_offload_cpu_size: cannot parse size"):
        LLM(kv_offload="cpu", kv_offload_cpu_size="lots")
    with pytest.raises(ConfigError, match=r"^max_num_sequences: is not an option"):
        LLM(max_num_sequences=3)
    with pytest.raises(ConfigError, match=r"^kv_redis_url: the redis tier needs a URL"):
        LLM(kv_offload="redis")
    with pytest.raises(ConfigError, match=r"^max_logprobs: "):
        LLM(max_logprobs=-1)


@pytest.mark.parametrize(("argv", "line"), [
    (["--kv-offload-cpu-size", "lots"], "kvtier serve: error: --kv-offload-cpu-size: cannot parse size 'lots'"),
    (["--kv-offload", "tape"], "kvtier serve: error: --kv-offload: unknown tier 'tape'"),
    (["--kv-offload", "redis"], "kvtier serve: error: --kv-redis-url: the redis tier needs a URL"),
    (["--block-size", "24"], "kvtier serve: error: --block-size: must be a positive power of two, got 24"),
    (["--kv-offload-disk-fsync", "always"], "kvtier serve: error: --kv-offload-disk-fsync: Input should be 'none', 'file' or 'full'"),
    (["--max-logprobs", "-1"], "kvtier serve: error: --max-logprobs: Input should be greater than or equal to 0"),
    (["--chat-template", "no/such.jinja"], "kvtier serve: error: --chat-template: 'no/such.jinja' is neither"),
])
def test_the_cli_process_names_the_flag_in_one_line(argv, line):
    # A hang still fails (under pytest's 600 s); a host at load 10-13 took over 120 s to
    # start the CLI process, which is no failure of the one-line error this test is about.
    done = subprocess.run([sys.executable, "-m", "engine.cli", "serve", *argv], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert done.returncode == 2
    assert done.stderr.startswith(line) and done.stderr.count("\n") == 1, done.stderr


def test_parser_flags_carry_no_values_of_their_own():
    """Unset flags are absent from the namespace: the tree supplies every default."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    assert vars(parser.parse_args([])) == {"config": None}
