"""Engine configuration: plain dataclasses validated in `__post_init__`.

User-caused problems raise `ConfigError` (a ValueError) naming the field and what is allowed.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strata import envs
from strata.gguf.file import find_gguf
from strata.gguf.file import load_config as load_gguf_config
from strata.platforms import Platform, get_platform
from strata.plugins import load_plugins

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


class ConfigError(ValueError):
    """A configuration value the user gave is not allowed."""


# Weight quantization methods `ModelConfig.quantization` accepts (None: the checkpoint's floats as they are).
QUANTIZATION_METHODS = ("int8",)
# `quant_method` of config.json's `quantization_config` in folders whose Linear weights are stored as int8
# (`strata convert gguf --keep-quantized`); such folders load with quantization="int8".
INT8_QUANT_METHOD = "strata_int8"


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


def _resolve_quantization(quantization: str | None, checkpoint_config: Any, folder: str) -> str | None:
    """The user's choice, checked; a folder stored quantized (`quantization_config`) turns int8 on itself."""
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise ConfigError(
            f"quantization must be None or one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}"
        )
    if checkpoint_config is None:
        return quantization
    method = checkpoint_config.get("quant_method") if isinstance(checkpoint_config, dict) else None
    if method != INT8_QUANT_METHOD:
        raise ConfigError(
            f"model folder {folder!r} is quantized with quant_method {method!r}; Strata loads only "
            f"{INT8_QUANT_METHOD!r} checkpoints (from `strata convert gguf --keep-quantized`) or float ones"
        )
    return "int8"


@dataclass
class ModelConfig:
    """Which model to run and how: the folder or GGUF file, dtype, context length and weight quantization.

    `model` is a Hugging Face folder (config.json and safetensors) or a GGUF file (or a folder holding one),
    whose quantized weights stay in their GGUF types; `gguf_dequantize` dequantizes, with a warning, the
    tensors of GGUF types Strata does not compute on, which are otherwise refused.
    `quantization="int8"` replaces the model's Linear layers with int8 weight-only ones, quantized per output
    channel from the checkpoint's weights as they load; a folder stored quantized sets it by itself.
    """

    model: str
    tokenizer: str | None = None
    dtype: str | torch.dtype = "float32"
    max_model_len: int | None = None
    seed: int = 0
    skip_tokenizer_init: bool = False
    quantization: str | None = None
    gguf_dequantize: bool = False
    hf_config: Any = field(init=False, repr=False)
    gguf_file: Path | None = field(init=False)
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self) -> None:
        from transformers import AutoConfig

        path = Path(self.model)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        self.gguf_file = find_gguf(path)
        if self.gguf_file is not None:
            self.hf_config = load_gguf_config(self.gguf_file)
        elif not path.is_dir():
            raise ConfigError(
                f"model must be a local model folder or a .gguf file; {self.model!r} is not a directory"
            )
        elif not (path / "config.json").is_file():
            raise ConfigError(f"model folder {self.model!r} has no config.json (nor a .gguf file)")
        else:
            try:
                self.hf_config = AutoConfig.from_pretrained(path)
            except (ValueError, KeyError, OSError, json.JSONDecodeError) as exc:
                raise ConfigError(f"could not read {path / 'config.json'}: {exc}") from exc
        if not isinstance(self.gguf_dequantize, bool):
            raise ConfigError(f"gguf_dequantize must be a boolean, got {self.gguf_dequantize!r}")
        if self.gguf_file is not None and self.quantization is not None:
            raise ConfigError(
                "quantization applies to Hugging Face folders; a GGUF file's weights keep their own types"
            )
        self.tokenizer = self.tokenizer or self.model
        text_config = self.hf_config.get_text_config()
        checkpoint_dtype = getattr(self.hf_config, "dtype", None) or getattr(
            self.hf_config, "torch_dtype", None
        )
        self.torch_dtype = resolve_dtype(self.dtype, checkpoint_dtype)
        self.quantization = _resolve_quantization(
            self.quantization, getattr(self.hf_config, "quantization_config", None), self.model
        )
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


# What `kv_cache_dtype` may name, as vLLM's option does: "auto" stores keys and values in the model's dtype.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class CacheConfig:
    """Paged KV cache: block size, how much memory, the dtype keys and values are stored in, and automatic
    prefix caching. A 16-bit cache under a float32 model halves what attention reads per token (llama.cpp
    keeps float16 keys and values by default); the attention math stays in the model's dtype."""

    block_size: int = 16
    # None takes STRATA_KV_CACHE_MEMORY; without it the model runner sizes the cache from free memory.
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.kv_cache_memory is None:
            self.kv_cache_memory = envs.kv_cache_memory_default()
        _check_positive_int("block_size", self.block_size)
        _check_positive_int("kv_cache_memory", self.kv_cache_memory, allow_none=True)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}"
            )

    def cache_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype the KV cache stores, for a model computing in `model_dtype`."""
        return model_dtype if self.kv_cache_dtype == "auto" else _DTYPES[self.kv_cache_dtype]


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


LAYER_IMPLS = ("default", "hw-agnostic")
FP32_MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclass
class LayerConfig:
    """Which layer implementations replace the HF model's norms and MLPs, and which ops use their fast path.

    `layer_impl` None takes STRATA_USE_HW_AGNOSTIC. `custom_ops` starts from "all" or "none" and adjusts
    single ops with "+name" / "-name" (vLLM's syntax); a disabled op runs its `forward_native`.
    `prepack_weights` lets layers replace their weights by a faster kernel's own layout after loading
    (None takes STRATA_PREPACK_WEIGHTS; on): each weight is still held once (`strata.platforms.cpu.layers.pack_in_place`).
    `fp32_matmul_precision` is the `torch.set_float32_matmul_precision` float32 weights are packed under
    (None: whatever torch's is when the model loads): "high" or "medium" lets CPUs with AMX multiply them as
    bf16x3 (`amx_panel_gemm.h`), "highest" keeps exact float32.
    """

    layer_impl: str | None = None
    # A tuple by default, so that the default is one plain value `EngineArgs` can take; held as a list.
    custom_ops: Sequence[str] = ("all",)
    prepack_weights: bool | None = None
    fp32_matmul_precision: str | None = None

    def __post_init__(self) -> None:
        if self.layer_impl is None:
            self.layer_impl = "hw-agnostic" if envs.use_hw_agnostic_default() else "default"
        if self.prepack_weights is None:
            self.prepack_weights = envs.prepack_weights_default()
        if self.layer_impl not in LAYER_IMPLS:
            raise ConfigError(f"layer_impl must be one of {', '.join(LAYER_IMPLS)}, got {self.layer_impl!r}")
        if isinstance(self.custom_ops, str) or not isinstance(self.custom_ops, list | tuple):
            raise ConfigError(f"custom_ops must be a list of strings, got {self.custom_ops!r}")
        self.custom_ops = list(self.custom_ops)
        if not isinstance(self.prepack_weights, bool):
            raise ConfigError(f"prepack_weights must be True or False, got {self.prepack_weights!r}")
        if (
            self.fp32_matmul_precision is not None
            and self.fp32_matmul_precision not in FP32_MATMUL_PRECISIONS
        ):
            raise ConfigError(
                f"fp32_matmul_precision must be one of {', '.join(FP32_MATMUL_PRECISIONS)}, "
                f"got {self.fp32_matmul_precision!r}"
            )
        bases = [op for op in self.custom_ops if op in ("all", "none")]
        if len(bases) > 1:
            raise ConfigError(f"custom_ops may hold one of 'all' or 'none', got {self.custom_ops!r}")
        for op in self.custom_ops:
            valid = isinstance(op, str) and (op in ("all", "none") or (op[:1] in ("+", "-") and len(op) > 1))
            if not valid:
                raise ConfigError(
                    f"custom_ops entries must be 'all', 'none', '+op_name' or '-op_name', got {op!r}"
                )

    @property
    def use_hw_agnostic(self) -> bool:
        return self.layer_impl == "hw-agnostic"

    def op_enabled(self, op_name: str) -> bool:
        """Whether `op_name` uses its platform fast path; the last matching +/- entry wins."""
        enabled = "none" not in self.custom_ops
        for op in self.custom_ops:
            if op[:1] in ("+", "-") and op[1:] == op_name:
                enabled = op[0] == "+"
        return enabled


_current_layer_config: ContextVar[LayerConfig | None] = ContextVar("strata_layer_config", default=None)


@contextmanager
def set_current_layer_config(layer_config: LayerConfig) -> Iterator[None]:
    """Make `layer_config` the one layers built inside this block see (model construction only)."""
    token = _current_layer_config.set(layer_config)
    try:
        yield
    finally:
        _current_layer_config.reset(token)


def get_current_layer_config() -> LayerConfig:
    """The layer config of the model being built; outside a build, the defaults (env included)."""
    return _current_layer_config.get() or LayerConfig()


COMPILE_MODES = ("model", "layer")


def _inductor_option(name: object) -> Any:
    """The `torch._inductor.config` entry `name` names (nested ones dotted, "cpp.threads"), or None."""
    import torch._inductor.config as inductor_config

    if not isinstance(name, str) or not all(name.split(".")):
        return None
    return inductor_config._config.get(name)


def _fits_type(value: object, value_type: Any) -> bool:
    """Whether `value` can be an option declared `value_type`: plain types, unions and generic containers
    are checked by their classes (`bool` is no `int` here, an `int` is a `float`); any other annotation
    (`Callable`, `Any`, ...) accepts every value."""
    if value_type is type(None):
        return value is None
    if isinstance(value_type, types.UnionType) or typing.get_origin(value_type) is typing.Union:
        return any(_fits_type(value, member) for member in typing.get_args(value_type))
    kind = typing.get_origin(value_type) or value_type
    if not isinstance(kind, type) or kind is object:
        return True
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _check_inductor_options(options: Any) -> None:
    """Fail at engine construction, not at the first compile, on an Inductor option that does not exist or a
    value of a type the option does not take (Inductor itself accepts any value and fails only when it reads
    it)."""
    if not isinstance(options, dict):
        raise ConfigError(
            f"inductor_compile_config must be a dict of Inductor option -> value, got {options!r}"
        )
    for name, value in options.items():
        entry = _inductor_option(name)
        if entry is None:
            raise ConfigError(
                f"inductor_compile_config: {name!r} is not an option of torch._inductor.config "
                "(nested options are dotted, as in 'cpp.threads')"
            )
        value_type = getattr(entry, "value_type", None)
        if value_type is None and entry.default is not None:
            value_type = type(entry.default)
        if value_type is not None and not _fits_type(value, value_type):
            expected = value_type.__name__ if isinstance(value_type, type) else str(value_type)
            raise ConfigError(
                f"inductor_compile_config: {name!r} takes a value of type {expected}, got {value!r}"
            )


@dataclass
class CompilationConfig:
    """Whether and how the model forward is compiled (`torch.compile` with Strata's piecewise backend).

    `use_layer_name` None takes STRATA_USE_LAYERNAME (on): layer-name ops get a `LayerName`, which compiles as
    a graph input, so identical layers share one compiled piece. It also applies without `compile`, because it
    selects the op variant at model build. `passes` maps a graph pass name to on/off; passes not named are on;
    the names are the platform's (`Platform.graph_passes`). `cache_dir` None takes STRATA_CACHE_ROOT/compile;
    `use_cache` None takes STRATA_DISABLE_COMPILE_CACHE. `mode` "model" (default) traces the whole forward:
    one graph, the fastest decode, but tracing time grows with depth; "layer" traces one decoder layer and
    reuses it for every layer of the same kind, so compile time is flat in depth (embedding, head and the loop
    over layers stay eager). Traces are saved with the compiled pieces, so a second start does neither. Guards
    pick the trace for the first call (per layer in "layer" mode); `evaluate_guards` checks them on every
    call, off they are skipped afterwards (nothing they check changes within an engine), which saves time on
    every step. Tests turn it on to prove that no batch size would have needed another trace.
    `inductor_compile_config` (vLLM's name) sets Inductor options for every piece over Strata's own
    (`compilation.backend.INDUCTOR_OPTIONS`), keyed by their `torch._inductor.config` names, for example
    `{"cpp.threads": 1}` for serial loops in Inductor's own kernels.
    """

    compile: bool | None = None
    mode: str = "model"
    use_layer_name: bool | None = None
    passes: dict[str, bool] = field(default_factory=dict)
    cache_dir: str | None = None
    use_cache: bool | None = None
    evaluate_guards: bool = False
    inductor_compile_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from strata.compilation.layer_name import HAS_OPAQUE_TYPE

        if self.compile is None:
            self.compile = envs.compile_default()
        if self.use_layer_name is None:
            self.use_layer_name = envs.use_layer_name_default() and HAS_OPAQUE_TYPE
        if self.use_cache is None:
            self.use_cache = not envs.disable_compile_cache()
        if self.cache_dir is None:
            self.cache_dir = str(Path(envs.cache_root()) / "compile")
        for name in ("compile", "use_layer_name", "use_cache", "evaluate_guards"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.mode not in COMPILE_MODES:
            raise ConfigError(f"mode must be one of {', '.join(COMPILE_MODES)}, got {self.mode!r}")
        if not isinstance(self.passes, dict):
            raise ConfigError(f"passes must be a dict of pass name -> bool, got {self.passes!r}")
        for name, enabled in self.passes.items():
            if not isinstance(name, str) or not isinstance(enabled, bool):
                raise ConfigError(
                    f"passes: {name!r}: {enabled!r} is not allowed; keys are pass names, values bools"
                )

        _check_inductor_options(self.inductor_compile_config)

    def pass_enabled(self, name: str) -> bool:
        return self.passes.get(name, True)


@dataclass
class ParallelConfig:
    """How many processes one engine runs on. With `tensor_parallel_size` N, N ranks each hold 1/N of the
    sharded weights and of the KV cache (the model's own TP plan says what is sharded); with
    `pipeline_parallel_size` M, M stages each hold a consecutive 1/M of the decoder layers (and their KV
    cache) and pass activations on; with both, each stage is sharded over N ranks (N x M in all). Rank 0
    schedules and samples. The ranks are processes the engine
    spawns on this machine, or those `torchrun` started (`distributed_init_method` "env://", its
    variables naming rank, world size and the store)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_init_method: str | None = None
    # Seconds a collective may wait for a rank before the engine fails naming it.
    distributed_timeout: float = 120.0
    # Replicas of the whole engine (each with the ranks above) behind one server, sharing nothing.
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_positive_int("data_parallel_size", self.data_parallel_size)
        _check_positive_int("tensor_parallel_size", self.tensor_parallel_size)
        _check_positive_int("pipeline_parallel_size", self.pipeline_parallel_size)
        if not isinstance(self.distributed_timeout, int | float) or self.distributed_timeout <= 0:
            raise ConfigError(
                f"distributed_timeout must be a positive number, got {self.distributed_timeout!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    """Everything one engine runs with. `device` names the platform ("cpu", "cuda:1", or a plugin's), which
    `platform` holds once checked; plugins load first, so their platforms can be named."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    layer_config: LayerConfig = field(default_factory=LayerConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    device: str = "cpu"
    # None takes STRATA_ADAPTIVE_THREADS (on): the platform's thread policy follows measured step times.
    adaptive_threads: bool | None = None
    platform: Platform = field(init=False, repr=False)
    torch_device: torch.device = field(init=False, repr=False)

    def __post_init__(self) -> None:
        load_plugins()
        try:
            self.platform = get_platform(self.device)
            self.torch_device = self.platform.torch_device(self.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        unknown = set(self.compilation_config.passes) - set(self.platform.graph_passes())
        if unknown:
            raise ConfigError(
                f"passes: {', '.join(sorted(unknown))} not among the {self.platform.name} platform's graph passes "
                f"({', '.join(self.platform.graph_passes()) or 'none'})"
            )
        self.scheduler_config.finalize(self.model_config.max_model_len)
        if self.adaptive_threads is None:
            self.adaptive_threads = envs.adaptive_threads_default()
        if not isinstance(self.adaptive_threads, bool):
            raise ConfigError(f"adaptive_threads must be a bool, got {self.adaptive_threads!r}")
