"""kvtier's LLM engine. `from engine import LLM, SamplingParams, Segments`."""

from importlib.metadata import PackageNotFoundError, version

from engine.logprobs import Logprob
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "Logprob", "SamplingParams", "Segments", "__version__"]

try:
    __version__ = version("kvtier")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    """Import the heavy engine modules only when they are used: the CLI's --help and its
    option checks run before torch is imported (engine.blend pulls it in, too)."""
    if name == "Segments":
        from engine.blend.segments import Segments

        return Segments
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(name)
