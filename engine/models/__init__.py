"""Our own forward passes for the Llama family (Llama, Mistral, Qwen2, Qwen3) and the
Hugging Face checkpoint loader. The transformers model classes are never run here."""

from engine.models.args import ModelLoadError, UnsupportedArchitectureError
from engine.models.llama import CausalLM
from engine.models.loader import load_model
from engine.models.spec import ModelSpec, resolve_dtype

__all__ = [
    "CausalLM",
    "ModelLoadError",
    "ModelSpec",
    "UnsupportedArchitectureError",
    "load_model",
    "resolve_dtype",
]
