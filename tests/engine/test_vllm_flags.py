"""What vLLM users paste (issue 44, item 16): its harmless flags accepted with a note,
--enforce-eager as --no-fuse-elementwise, --gpu-memory-utilization as the share of the
device's memory (the host's on CPU) the instance may hold; `kvtier --version`;
`download-model` saying what it does."""

from __future__ import annotations

import logging

import pytest

from engine import __version__
from engine.arg_utils import load_options
from engine.cli import build_parser, main
from engine.config import ConfigError, EngineConfig, ServerConfig, host_memory, resident_memory

GiB = 1024**3


def serve_options(*argv: str) -> EngineConfig:
    config, _ = load_options(build_parser().parse_args(["serve", *argv]), EngineConfig, ServerConfig)
    return config


def test_harmless_vllm_flags_are_accepted_with_a_note(caplog):
    with caplog.at_level(logging.WARNING):
        config = serve_options("--tensor-parallel-size", "1", "--enable-chunked-prefill", "--disable-log-requests",
                               "--trust-remote-code")
    for flag in ("--tensor-parallel-size", "--enable-chunked-prefill", "--disable-log-requests", "--trust-remote-code"):
        assert any(r.getMessage().startswith(f"{flag}: accepted, changes nothing (") for r in caplog.records), flag
    assert EngineConfig(**config.model_dump()) == config  # folded away: a copy is the same config


def test_enforce_eager_runs_eager_ops():
    assert serve_options("--enforce-eager").fuse_elementwise is False
    assert serve_options().fuse_elementwise is True


@pytest.mark.parametrize(("argv", "error"), [
    (["--tensor-parallel-size", "2"], r"^--tensor-parallel-size: kvtier runs one device per instance; only 1"),
    (["--no-enable-chunked-prefill"], r"^--enable-chunked-prefill: .* it cannot be off"),
    (["--gpu-memory-utilization", "0.5", "--kv-cache-memory", "1"], r"^--gpu-memory-utilization: give it or --kv-cache"),
    (["--gpu-memory-utilization", "1.5"], r"^--gpu-memory-utilization: Input should be less than or equal to 1"),
    (["--enforce-eager", "--fuse-elementwise"], r"^--enforce-eager: give it or --fuse-elementwise"),
])
def test_what_kvtier_cannot_do_is_refused_in_one_line(argv, error):
    with pytest.raises(ConfigError, match=error):
        serve_options(*argv)


def test_gpu_memory_utilization_is_a_share_of_host_memory_on_cpu():
    from engine.llm_engine import LLMEngine

    total, room = host_memory(), 384 * 1024**2
    share = (resident_memory() + room) / total  # room for the tiny weights and a pool beside what is held now
    engine = LLMEngine(EngineConfig(model="builtin:tiny", device="cpu", gpu_memory_utilization=share))
    try:
        pool = engine.num_kv_blocks * engine.block_bytes
        assert 0 < pool <= room  # what the weights left of the share, not the 1 GiB default
    finally:
        engine.shutdown()
    with pytest.raises(ConfigError, match=r"^--gpu-memory-utilization: 1e-06 of .* leaves nothing for the KV pool"):
        LLMEngine(EngineConfig(model="builtin:tiny", device="cpu", gpu_memory_utilization=1e-6))


def test_kvtier_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"kvtier {__version__}\n"


def test_download_model_says_each_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert main(["download-model", "tiny"]) == 0
    out, err = capsys.readouterr()
    assert out.strip().endswith("random-llama-tiny-v1")
    lines = err.splitlines()
    assert "making a random-weight model (tiny preset)" in lines[0] and lines[-1].endswith(" done"), err
    assert main(["download-model", "tiny"]) == 0
    assert "builtin:tiny is installed already" in capsys.readouterr().err
