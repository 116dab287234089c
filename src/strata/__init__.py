"""Strata: a hardware-agnostic LLM inference engine for Hugging Face transformers models."""

from strata.outputs import CompletionOutput, Logprob, RequestOutput
from strata.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]


def __getattr__(name: str):
    # `LLM` pulls in torch and transformers; keep `import strata` light for the CLI's --help and converters.
    if name == "LLM":
        from strata.entrypoints.llm import LLM

        return LLM
    raise AttributeError(f"module 'strata' has no attribute {name!r}")
