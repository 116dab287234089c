"""Converters from other model formats (llama2.c, GGUF) to standard Hugging Face folders."""

from strata.converters.errors import ConversionError
from strata.converters.gguf import convert_gguf
from strata.converters.llama2c import convert_llama2c

__all__ = ["ConversionError", "convert_gguf", "convert_llama2c"]
