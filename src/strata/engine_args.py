"""`EngineArgs`: every option of an engine, with its default and one line of help, in one place.

`LLM`'s keyword arguments and the engine options of `strata generate`, `serve` and `layers` are its fields;
the defaults are those of the config dataclasses (read from them, so each is stated once), and
`create_engine_config` turns the options into the `EngineConfig` they describe.
"""

from __future__ import annotations

import argparse
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch

from strata.bundled import default_model
from strata.config import (
    FP32_MATMUL_PRECISIONS,
    KV_CACHE_DTYPES,
    LAYER_IMPLS,
    QUANTIZATION_METHODS,
    CacheConfig,
    CompilationConfig,
    ConfigError,
    EngineConfig,
    LayerConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)


def _option(config: type, name: str, help: str, **cli: Any) -> Any:
    """The field of `config`'s option `name`: its default is the one `config` states. `cli` adds what the
    command line needs beyond the field's type: `aliases` (short flags), `choices`, `parse` (its argparse
    type, where that is not the field's)."""
    default = config.__dataclass_fields__[name].default
    if default is MISSING:
        raise TypeError(f"{config.__name__}.{name} has no plain default for EngineArgs to take")
    return field(default=default, metadata={"config": config, "help": help, **cli})


def _comma_separated(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]


def _compilation_config(
    compile: bool | None, config: CompilationConfig | Mapping[str, Any] | None
) -> CompilationConfig:
    """`compile=` wins over the config's own `compile`; a dict is validated field by field."""
    if config is None:
        config = CompilationConfig()
    elif isinstance(config, Mapping):
        known = set(CompilationConfig.__dataclass_fields__)
        unknown = set(config) - known
        if unknown:
            raise ConfigError(
                f"compilation_config: unknown keys {sorted(unknown)}; allowed are {', '.join(sorted(known))}"
            )
        config = CompilationConfig(**config)
    elif not isinstance(config, CompilationConfig):
        raise TypeError(
            f"compilation_config must be a CompilationConfig or a dict, got {type(config).__name__}"
        )
    if compile is not None:
        if not isinstance(compile, bool):
            raise ConfigError(f"compile must be a bool, got {compile!r}")
        config.compile = compile
    return config


def _cli_type(hint: Any) -> Any:
    """The argparse type of an option annotated `hint`: its first member other than None (`int | None` is
    an int, `str | torch.dtype` a str)."""
    members = [member for member in typing.get_args(hint) or (hint,) if member is not type(None)]
    return members[0]


@dataclass
class EngineArgs:
    """The options of one engine. Each field names the config dataclass it configures (`metadata["config"]`)
    and says what it does in one line (`metadata["help"]`)."""

    # What model, and what it computes in (ModelConfig).
    model: str | None = field(
        default=None,
        metadata={
            "config": ModelConfig,
            "help": "a local Hugging Face model folder or .gguf file (default: the bundled stories260K)",
        },
    )
    tokenizer: str | None = _option(ModelConfig, "tokenizer", "a tokenizer folder (default: the model's)")
    dtype: str | torch.dtype = _option(  # noqa: RUF009 (a dataclasses.field, as every _option)
        ModelConfig,
        "dtype",
        "what the model computes in: float32, bfloat16, float16 or auto (the checkpoint's)",
    )
    max_model_len: int | None = _option(
        ModelConfig, "max_model_len", "context length in tokens (default: the model's)"
    )
    seed: int = _option(ModelConfig, "seed", "the engine's sampling seed, for requests that give none")
    skip_tokenizer_init: bool = _option(
        ModelConfig, "skip_tokenizer_init", "load no tokenizer: prompts are token ids, outputs have no text"
    )
    quantization: str | None = _option(
        ModelConfig,
        "quantization",
        "int8: weight-only int8 Linear layers, quantized per channel at load (default: off, or what the model "
        "folder was stored as)",
        choices=QUANTIZATION_METHODS,
    )
    gguf_dequantize: bool = _option(
        ModelConfig,
        "gguf_dequantize",
        "dequantize GGUF tensors of types Strata does not compute on (IQ*, TQ*) at load, with a warning, "
        "instead of refusing the file",
    )

    # Where it runs (EngineConfig).
    device: str = _option(
        EngineConfig, "device", "the platform to run on: cpu, cuda, cuda:N, or a plugin's platform"
    )
    adaptive_threads: bool | None = _option(
        EngineConfig,
        "adaptive_threads",
        "let the CPU thread count follow measured step times (default: STRATA_ADAPTIVE_THREADS, on)",
    )

    # The paged KV cache (CacheConfig).
    block_size: int = _option(CacheConfig, "block_size", "tokens per KV-cache block")
    kv_cache_memory: int | None = _option(
        CacheConfig,
        "kv_cache_memory",
        "bytes for the KV cache (default: STRATA_KV_CACHE_MEMORY, else max_num_seqs full-length sequences, "
        "at most a quarter of free memory)",
    )
    kv_cache_dtype: str = _option(
        CacheConfig,
        "kv_cache_dtype",
        "dtype the KV cache stores keys and values in; auto: the model's dtype",
        choices=KV_CACHE_DTYPES,
    )
    enable_prefix_caching: bool = _option(
        CacheConfig, "enable_prefix_caching", "reuse the KV cache of prompt prefixes computed before"
    )

    # Each step's batch (SchedulerConfig).
    max_num_seqs: int = _option(SchedulerConfig, "max_num_seqs", "most sequences in one batch")
    max_num_batched_tokens: int | None = _option(
        SchedulerConfig,
        "max_num_batched_tokens",
        "most tokens in one step (default: 2048, or a whole prompt when chunked prefill is off)",
    )
    enable_chunked_prefill: bool = _option(
        SchedulerConfig, "enable_chunked_prefill", "let a long prompt take several steps"
    )

    # Which implementation each layer runs (LayerConfig).
    layer_impl: str | None = _option(
        LayerConfig,
        "layer_impl",
        "layer implementations: default, or hw-agnostic (every op's pure-PyTorch reference) "
        "(default: hw-agnostic when STRATA_USE_HW_AGNOSTIC=1, else default)",
        choices=LAYER_IMPLS,
    )
    custom_ops: Sequence[str] = _option(
        LayerConfig,
        "custom_ops",
        "which ops use their platform's implementation: 'all' or 'none', then '+op' or '-op' entries; "
        "comma-separated on the command line, e.g. 'all,-silu_and_mul' or 'none,+rms_norm'",
        parse=_comma_separated,
    )
    prepack_weights: bool | None = _option(
        LayerConfig,
        "prepack_weights",
        "replace float32 CPU linear weights by Strata's GEMM panels after loading (AVX-512 builds), read at "
        "every batch size; each weight is still held once (default: STRATA_PREPACK_WEIGHTS, on)",
    )
    fp32_matmul_precision: str | None = _option(
        LayerConfig,
        "fp32_matmul_precision",
        "torch.set_float32_matmul_precision for packing float32 weights: 'high' multiplies them as bf16x3 on "
        "CPUs with AMX, at every row count (default: torch's own setting, 'highest' unless changed)",
        choices=FP32_MATMUL_PRECISIONS,
    )

    # Compilation (CompilationConfig).
    compile: bool | None = _option(
        CompilationConfig,
        "compile",
        "torch.compile the model forward, piecewise (default: STRATA_COMPILE, off)",
    )
    compilation_config: CompilationConfig | Mapping[str, Any] | None = field(
        default=None,
        metadata={
            "config": CompilationConfig,
            "help": "how the forward is compiled: a CompilationConfig or a dict of its fields (compile, when "
            "given, wins over its own)",
        },
    )

    # Processes (ParallelConfig).
    tensor_parallel_size: int = _option(
        ParallelConfig,
        "tensor_parallel_size",
        "processes the model is sharded over, each with its share of the cores",
        aliases=("-tp",),
    )
    pipeline_parallel_size: int = _option(
        ParallelConfig,
        "pipeline_parallel_size",
        "pipeline stages the decoder layers are split over, a process each",
        aliases=("-pp",),
    )
    data_parallel_size: int = _option(
        ParallelConfig,
        "data_parallel_size",
        "engine replicas behind the server, each a process with its share of the cores; a request goes to "
        "the replica with the fewest unfinished requests",
        aliases=("-dp",),
    )
    distributed_timeout: float = _option(
        ParallelConfig,
        "distributed_timeout",
        "seconds a collective may wait for a rank before the engine fails naming it",
    )
    distributed_init_method: str | None = _option(
        ParallelConfig,
        "distributed_init_method",
        "where the ranks meet, a torch.distributed init method such as tcp://HOST:PORT (default: a free "
        "local port)",
    )

    def _options_for(self, config: type) -> dict[str, Any]:
        """The options that configure `config`, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata["config"] is config}

    def create_engine_config(self) -> EngineConfig:
        """The engine configuration these options describe, each checked by its config dataclass."""
        model_options = self._options_for(ModelConfig)
        if self.model is None:
            model_options["model"] = default_model()
        return EngineConfig(
            model_config=ModelConfig(**model_options),
            cache_config=CacheConfig(**self._options_for(CacheConfig)),
            scheduler_config=SchedulerConfig(**self._options_for(SchedulerConfig)),
            layer_config=LayerConfig(**self._options_for(LayerConfig)),
            compilation_config=_compilation_config(self.compile, self.compilation_config),
            parallel_config=ParallelConfig(**self._options_for(ParallelConfig)),
            **self._options_for(EngineConfig),
        )

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
        """Add the options `names` (fields, in the order given) to `parser` as `--the-name` flags: type,
        choices, default and help are the field's; a bool is a `--name/--no-name` pair."""
        hints = typing.get_type_hints(cls)
        by_name = {option.name: option for option in fields(cls)}
        for name in names:
            option = by_name[name]
            flags = [f"--{name.replace('_', '-')}", *option.metadata.get("aliases", ())]
            kwargs: dict[str, Any] = {"default": option.default, "help": option.metadata["help"]}
            value_type = _cli_type(hints[name])
            if value_type is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                kwargs["type"] = option.metadata.get("parse", value_type)
                kwargs["choices"] = option.metadata.get("choices")
                if option.default is not None:
                    shown = ",".join(option.default) if isinstance(option.default, tuple) else option.default
                    kwargs["help"] += f" (default: {shown})"
            parser.add_argument(*flags, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, names: Iterable[str]) -> EngineArgs:
        """The options `names` as `add_cli_args` parsed them into `args`; the others keep their defaults (a
        command may have other options of the same name, such as `generate`'s request `--seed`)."""
        return cls(**{name: getattr(args, name) for name in names})
