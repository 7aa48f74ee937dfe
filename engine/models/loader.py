"""Load a checkpoint into our model: a Hugging Face directory (config.json + safetensors)
or a GGUF file (engine/models/gguf.py). Both end in the same weight copy, keyed by
Hugging Face tensor names."""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from engine.model_files import is_gguf
from engine.models.args import ModelArgs, ModelLoadError, architecture_of, args_from_config
from engine.models.gguf import GGUFCheckpoint
from engine.models.layers import Linear
from engine.models.llama import CausalLM
from engine.models.spec import ModelSpec, config_dtype_name, eos_token_ids, read_json, resolve_dtype

logger = logging.getLogger(__name__)

DIGEST_READ_BYTES = 64 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"
# checkpoint tensors that carry nothing we compute with
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path: str | os.PathLike[str], dtype: str | torch.dtype, device: torch.device | str
) -> tuple[CausalLM, ModelSpec]:
    """Build our model for the checkpoint at `path` (a directory or a .gguf file) and
    fill its weights. `dtype` may be "auto": the dtype the checkpoint declares, or float32
    on a CPU without native matmuls for it (`resolve_dtype`)."""
    path = os.fspath(path)
    if is_gguf(path):
        return _load_gguf(path, dtype, torch.device(device))
    config = read_config(path)
    dtype = _model_dtype(dtype, config, device)
    args = args_from_config(config)
    files = weight_files(path)
    model = CausalLM(args, dtype, torch.device(device))
    load_weights(model, _safetensors(files))
    model.eval()
    generation = read_json(os.path.join(path, "generation_config.json"))
    return model, _spec(path, config, generation, args, weights_digest(files))


def _load_gguf(
    path: str, dtype: str | torch.dtype, device: torch.device
) -> tuple[CausalLM, ModelSpec]:
    checkpoint = GGUFCheckpoint(path)
    config = SimpleNamespace(**checkpoint.config)
    dtype = _model_dtype(dtype, config, device)
    args = args_from_config(config)
    model = CausalLM(args, dtype, device)
    load_weights(model, checkpoint.dequantized(dtype))
    model.eval()
    return model, _spec(path, config, {}, args, weights_digest([path]))


def _model_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    """`resolve_dtype` on `device`, saying so when auto set the declared dtype aside."""
    resolved = resolve_dtype(dtype, config, device)
    declared = resolve_dtype(dtype, config)
    if resolved != declared:
        name = str(declared).removeprefix("torch.")
        logger.info("--dtype auto: float32 rather than the declared %s, which this CPU has no native "
                    "matmuls for (--dtype %s forces it)", name, name)
    return resolved


def tokenizer_digest(tokenizer: Any) -> str:
    """SHA-256 hex of how `tokenizer` maps text to token ids.

    Text becomes keys through it (segment keys of a blended prompt, pinned prefixes), so
    it is part of the model fingerprint: two instances with the same weights and another
    tokenizer must not share keys. A fast tokenizer is taken as the tokenizers library
    serializes it (vocabulary, merges, normalizer, pre-tokenizer, post-processor, added
    tokens: a canonical JSON, so tokenizer.json's formatting does not matter); any other
    by its class and its vocabulary in id order.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        canonical = backend.to_str()
    else:
        vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: (item[1], item[0]))
        canonical = json.dumps([type(tokenizer).__name__, vocab], separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def checkpoint_config(path: str) -> dict[str, Any]:
    """The config.json fields of a checkpoint directory or GGUF file (no weights read)."""
    if is_gguf(path):
        return GGUFCheckpoint(path).config
    return read_json(os.path.join(path, "config.json"))


def read_config(path: str) -> Any:
    """config.json through transformers' AutoConfig, after checking the architecture."""
    raw = read_json(os.path.join(path, "config.json"))
    if not raw:
        raise ModelLoadError(
            f"--model {path}: no config.json; expected a Hugging Face checkpoint directory"
        )
    architecture_of(SimpleNamespace(**raw))
    return AutoConfig.from_pretrained(path, local_files_only=True)


def weight_files(path: str) -> list[str]:
    """The checkpoint's safetensors files, in a fixed (sorted) order."""
    index = read_json(os.path.join(path, INDEX_FILE))
    if index:
        names = sorted(set(index.get("weight_map", {}).values()))
        files = [os.path.join(path, name) for name in names]
        absent = [f for f in files if not os.path.exists(f)]
        if absent:
            raise ModelLoadError(f"{path}: {INDEX_FILE} lists missing files {absent}")
        return files
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ModelLoadError(
            f"{path}: no *.safetensors weights (.bin checkpoints are not supported)"
        )
    return files


def weights_digest(files: list[str]) -> str:
    """xxh3-128 hex over the bytes of `files`, concatenated in the given order."""
    digest = xxhash.xxh3_128()
    for name in files:
        with open(name, "rb") as f:
            while chunk := f.read(DIGEST_READ_BYTES):
                digest.update(chunk)
    return digest.hexdigest()


def _safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name)


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy every (Hugging Face name, tensor) into place; raise on missing or unexpected
    tensors."""
    targets = checkpoint_targets(model)
    loaded, unexpected = set(), []
    with torch.no_grad():
        for name, tensor in tensors:
            if name in targets:
                _copy(name, targets[name], tensor)
                loaded.add(name)
            elif not _ignored(name, model.args):
                unexpected.append(name)
    missing = sorted(set(targets) - loaded)
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint does not match {model.args.architecture}: "
            f"missing {_some(missing)}, unexpected {_some(unexpected)}"
        )


def checkpoint_targets(model: nn.Module) -> dict[str, tuple[nn.Module, str | None, str]]:
    """Checkpoint tensor name -> (our module, fused shard name or None, "weight"/"bias")."""
    targets: dict[str, tuple[nn.Module, str | None, str]] = {}
    for path, module in model.named_modules():
        for param, _ in module.named_parameters(recurse=False):
            if isinstance(module, Linear):
                parent = path.rpartition(".")[0]
                for shard in module.shards:
                    name = f"{parent}.{shard}.{param}" if parent else f"{shard}.{param}"
                    targets[name] = (module, shard, param)
            else:
                targets[f"{path}.{param}"] = (module, None, param)
    return targets


def _copy(name: str, target: tuple[nn.Module, str | None, str], tensor: torch.Tensor) -> None:
    module, shard, param = target
    try:
        if isinstance(module, Linear) and shard is not None:
            module.load_shard(shard, param, tensor)
            return
        dest = getattr(module, param)
        if dest.shape != tensor.shape:
            raise ValueError(f"shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)
    except ValueError as e:
        raise ModelLoadError(f"weight {name}: {e}") from e


def _ignored(name: str, args: ModelArgs) -> bool:
    if name.endswith(IGNORED_SUFFIXES):
        return True
    return args.tie_word_embeddings and name == "lm_head.weight"


def _some(names: list[str], limit: int = 5) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _spec(
    path: str, config: Any, generation: dict[str, Any], args: ModelArgs, digest: str
) -> ModelSpec:
    max_positions = args.max_position_embeddings
    if args.sliding_window is not None and args.sliding_window < max_positions:
        logger.warning(
            "%s uses sliding-window attention (window %d), which is not implemented; "
            "limiting the context to the window so outputs stay exact",
            path,
            args.sliding_window,
        )
        max_positions = args.sliding_window
    bos = getattr(config, "bos_token_id", None)
    return ModelSpec(
        architecture=args.architecture,
        model_type=args.model_type,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        hidden_size=args.hidden_size,
        vocab_size=args.vocab_size,
        max_position_embeddings=max_positions,
        eos_token_ids=eos_token_ids(config, generation),
        bos_token_id=bos if bos is not None else generation.get("bos_token_id"),
        torch_dtype=config_dtype_name(config),
        weights_digest=digest,
        config_digest=args.digest,
    )
