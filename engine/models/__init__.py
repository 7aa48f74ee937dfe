"""Our own forward passes for the Llama family (Llama, Mistral, Qwen2, Qwen3) and the
loaders of Hugging Face checkpoint directories and GGUF files. The transformers model
classes are never run here."""

from engine.model_files import load_tokenizer
from engine.models.args import ModelLoadError, UnsupportedArchitectureError
from engine.models.llama import CausalLM
from engine.models.loader import checkpoint_config, load_model, tokenizer_digest
from engine.models.spec import ModelSpec, resolve_dtype

__all__ = [
    "CausalLM",
    "ModelLoadError",
    "ModelSpec",
    "UnsupportedArchitectureError",
    "checkpoint_config",
    "load_model",
    "load_tokenizer",
    "resolve_dtype",
    "tokenizer_digest",
]
