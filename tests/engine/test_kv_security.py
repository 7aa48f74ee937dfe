"""Shared tiers without --kv-secret warn at start (Redis off loopback, a disk directory
another process uses or other users may write to); --kv-secret-file reads the secret."""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import LLM
from engine.arg_utils import add_config_arguments, config_from_args
from engine.config import ConfigError, EngineConfig
from engine.kv_security import shared_tiers_without_secret

REPO = Path(__file__).resolve().parents[2]
HOLDER = """
import sys
from engine.config import EngineConfig
from engine.kv_security import shared_tiers_without_secret
shared_tiers_without_secret(EngineConfig(kv_offload="disk", kv_offload_disk_path=sys.argv[1]))
print("ready", flush=True)
sys.stdin.read()
"""


def redis(url: str, **extra) -> EngineConfig:
    return EngineConfig(kv_offload="cpu,redis", kv_redis_url=url, **extra)


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379", "redis://localhost:6379", "redis://[::1]:6379", "redis://127.0.0.2:7000/2",
    "redis+cluster://127.0.0.1:7000,127.0.0.1:7001",
])
def test_a_loopback_redis_needs_no_secret(url):
    assert shared_tiers_without_secret(redis(url)) == []


@pytest.mark.parametrize(("url", "named"), [
    ("redis://10.1.2.3:6379", "10.1.2.3:6379"), ("rediss://:pw@cache.internal:6380", "cache.internal:6380"),
    ("redis+cluster://127.0.0.1:7000,10.0.0.9:7001", "10.0.0.9:7001"),
])
def test_a_redis_off_loopback_without_a_secret_is_reported(url, named):
    reasons = shared_tiers_without_secret(redis(url))
    assert len(reasons) == 1 and named in reasons[0] and "loopback" in reasons[0]
    assert shared_tiers_without_secret(redis(url, kv_secret="s" * 16)) == []


def hold(directory: Path) -> subprocess.Popen:
    """Another process that uses `directory` as its disk tier until its stdin closes."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert holder.stdout.readline().strip() == "ready"
    return holder


def release(holder: subprocess.Popen) -> None:
    holder.stdin.close()
    assert holder.wait(30) == 0


@pytest.fixture
def other_process(tmp_path: Path) -> Iterator[Path]:
    """A directory that another running process uses as its disk tier."""
    directory = tmp_path / "shared"
    directory.mkdir(mode=0o700)
    holder = hold(directory)
    yield directory
    release(holder)


def disk(directory: Path, **extra) -> EngineConfig:
    return EngineConfig(kv_offload="cpu,disk", kv_offload_disk_path=str(directory), **extra)


def test_a_disk_directory_of_this_process_alone_needs_no_secret(tmp_path):
    directory = tmp_path / "mine"
    directory.mkdir(mode=0o700)
    assert shared_tiers_without_secret(disk(directory)) == []
    assert shared_tiers_without_secret(disk(directory)) == []  # a second engine of this process


def test_a_disk_directory_another_process_uses_is_reported(other_process):
    reasons = shared_tiers_without_secret(disk(other_process))
    assert reasons == [f"the disk directory {other_process} is used by another running process"]
    assert shared_tiers_without_secret(disk(other_process, kv_secret="s" * 16)) == []


def test_the_report_ends_with_the_other_process(tmp_path):
    directory = tmp_path / "later"
    directory.mkdir(mode=0o700)
    holder = hold(directory)
    assert shared_tiers_without_secret(disk(directory)) != []
    release(holder)
    assert shared_tiers_without_secret(disk(directory)) == []


def test_a_disk_directory_others_may_write_to_is_reported(tmp_path):
    directory = tmp_path / "open"
    directory.mkdir()
    directory.chmod(0o777)
    assert shared_tiers_without_secret(disk(directory)) == [f"the disk directory {directory} is writable by other users"]


def test_the_engine_warns_at_start(other_process, tiny_model_factory, caplog):
    model = tiny_model_factory()
    with caplog.at_level(logging.WARNING, logger="engine.kv_security"):
        LLM(model=model, dtype="float32", num_kv_blocks=16, kv_offload="disk",
            kv_offload_disk_path=str(other_process)).close()
        warned = [r.getMessage() for r in caplog.records]
        caplog.clear()
        LLM(model=model, dtype="float32", num_kv_blocks=16, kv_offload="disk",
            kv_offload_disk_path=str(other_process), kv_secret="s" * 16).close()
    assert len(warned) == 1 and "used by another running process" in warned[0] and "--kv-secret" in warned[0]
    assert caplog.records == []


def test_kv_secret_file_reads_the_secret(tmp_path):
    path = tmp_path / "secret"
    path.write_text("correct horse battery staple\n")
    config = EngineConfig(kv_secret_file=str(path))
    assert config.kv_secret == "correct horse battery staple"
    assert "correct horse" not in repr(config)
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, EngineConfig)
    assert config_from_args(parser.parse_args(["--kv-secret-file", str(path)])).kv_secret == config.kv_secret


@pytest.mark.parametrize(("content", "extra", "message"), [
    (None, {}, "cannot read"), ("\n", {}, "holds no secret"), ("s\n", {"kv_secret": "other"}, "not both"),
])
def test_a_bad_kv_secret_file_is_a_config_error(tmp_path, content, extra, message):
    path = tmp_path / "secret"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=message) as failure:
        EngineConfig(kv_secret_file=str(path), **extra)
    assert str(failure.value).startswith("--kv-secret-file")
