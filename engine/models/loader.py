"""Load a Hugging Face checkpoint directory (config.json + safetensors) into our model."""

from __future__ import annotations

import glob
import logging
import os
from types import SimpleNamespace
from typing import Any

import torch
import xxhash
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig

from engine.models.args import ModelArgs, ModelLoadError, architecture_of, args_from_config
from engine.models.layers import Linear
from engine.models.llama import CausalLM
from engine.models.spec import ModelSpec, config_dtype_name, eos_token_ids, read_json

logger = logging.getLogger(__name__)

DIGEST_READ_BYTES = 64 * 1024 * 1024
INDEX_FILE = "model.safetensors.index.json"
# checkpoint tensors that carry nothing we compute with
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_model(
    path: str | os.PathLike[str], dtype: torch.dtype, device: torch.device | str
) -> tuple[CausalLM, ModelSpec]:
    """Build our model for the checkpoint in directory `path` and fill its weights."""
    path = os.fspath(path)
    config = read_config(path)
    args = args_from_config(config)
    files = weight_files(path)
    model = CausalLM(args, dtype, torch.device(device))
    load_weights(model, files)
    model.eval()
    return model, _spec(path, config, args, files)


def read_config(path: str) -> Any:
    """config.json through transformers' AutoConfig, after checking the architecture."""
    raw = read_json(os.path.join(path, "config.json"))
    if not raw:
        raise ModelLoadError(
            f"{path}: no config.json; expected a Hugging Face checkpoint directory"
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


def load_weights(model: CausalLM, files: list[str]) -> None:
    """Copy every checkpoint tensor into place; raise on missing or unexpected tensors."""
    targets = checkpoint_targets(model)
    loaded, unexpected = set(), []
    with torch.no_grad():
        for file in files:
            with safe_open(file, framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if name in targets:
                        _copy(name, targets[name], f.get_tensor(name))
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


def _spec(path: str, config: Any, args: ModelArgs, files: list[str]) -> ModelSpec:
    generation = read_json(os.path.join(path, "generation_config.json"))
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
        weights_digest=weights_digest(files),
    )
