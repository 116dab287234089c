"""Engine configuration: plain dataclasses validated in `__post_init__`.

User-caused problems raise `ConfigError` (a ValueError) naming the field and what is allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata import envs

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ConfigError(ValueError):
    """A configuration value the user gave is not allowed."""


def _check_positive_int(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def resolve_dtype(dtype: str | torch.dtype, checkpoint_dtype: str | None) -> torch.dtype:
    """`"auto"` takes the checkpoint's dtype (float32 when it names none)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ConfigError(f"dtype must be one of float32, bfloat16, float16 or auto, got {dtype}")
        return dtype
    if not isinstance(dtype, str):
        raise ConfigError(f"dtype must be a string such as 'float32', got {type(dtype).__name__}")
    if dtype == "auto":
        return _DTYPES.get(str(checkpoint_dtype).removeprefix("torch."), torch.float32)
    if dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of float32, bfloat16, float16 or auto, got {dtype!r}")
    return _DTYPES[dtype]


@dataclass
class ModelConfig:
    """Which model to run and how: the folder, dtype and context length."""

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "float32"
    max_model_len: int | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    hf_config: Any = field(init=False, repr=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        from transformers import AutoConfig

        path = Path(self.model)
        if not path.is_dir():
            raise ConfigError(f"model must be a local model folder; {self.model!r} is not a directory")
        if not (path / "config.json").is_file():
            raise ConfigError(f"model folder {self.model!r} has no config.json")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        try:
            self.hf_config = AutoConfig.from_pretrained(path)
        except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"could not read {path / 'config.json'}: {exc}") from exc
        self.tokenizer = self.tokenizer or self.model
        text_config = self.hf_config.get_text_config()
        checkpoint_dtype = getattr(self.hf_config, "dtype", None) or getattr(
            self.hf_config, "torch_dtype", None
        )
        self.torch_dtype = resolve_dtype(self.dtype, checkpoint_dtype)
        limit = getattr(text_config, "max_position_embeddings", None)
        _check_positive_int("max_model_len", self.max_model_len, allow_none=True)
        if self.max_model_len is None:
            if limit is None:
                raise ConfigError(
                    "max_model_len must be given: the model config has no max_position_embeddings"
                )
            self.max_model_len = int(limit)
        elif limit is not None and self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len={self.max_model_len} is longer than the model's max_position_embeddings={limit}"
            )

    @property
    def text_config(self) -> Any:
        return self.hf_config.get_text_config()

    @property
    def vocab_size(self) -> int:
        return int(self.text_config.vocab_size)


@dataclass
class CacheConfig:
    """Paged KV cache: block size, how much memory, and automatic prefix caching."""

    block_size: int = 16
    kv_cache_memory: int | None = field(default_factory=envs.kv_cache_memory_default)
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("kv_cache_memory", self.kv_cache_memory, allow_none=True)


@dataclass
class SchedulerConfig:
    """Continuous batching limits per step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        _check_positive_int("max_num_seqs", self.max_num_seqs)
        _check_positive_int("max_num_batched_tokens", self.max_num_batched_tokens, allow_none=True)

    def finalize(self, max_model_len: int) -> None:
        """Default the token budget: 2048, or a whole prompt per step when chunked prefill is off."""
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(2048, max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than max_model_len={max_model_len};"
                " enable chunked prefill or raise it"
            )


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: str = "cpu"

    def __post_init__(self) -> None:
        self.scheduler_config.finalize(self.model_config.max_model_len)
