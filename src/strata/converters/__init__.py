"""Converters from other model formats to standard Hugging Face folders: llama2.c checkpoints, and the
folder and SentencePiece tokenizer writers that the GGUF converter (`strata.gguf.converter`) shares."""

from strata.converters.errors import ConversionError
from strata.converters.llama2c import convert_llama2c

__all__ = ["ConversionError", "convert_llama2c"]
