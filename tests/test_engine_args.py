"""`EngineArgs` is the one source of the engine's options: `LLM`'s keyword arguments, the engine options of
`strata generate`, `serve` and `layers`, and the config dataclasses cannot disagree on a name, a default or
where a value ends up."""

from __future__ import annotations

import argparse
import inspect
import typing
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from strata import LLM
from strata.config import ConfigError, EngineConfig, LayerConfig, ModelConfig
from strata.engine_args import EngineArgs
from strata.entrypoints.cli import GENERATE_OPTIONS, build_parser
from strata.entrypoints.layers_cli import LAYERS_OPTIONS
from strata.entrypoints.llm import default_model
from strata.entrypoints.openai.cli_args import SERVE_OPTIONS

FIELDS = {option.name: option for option in fields(EngineArgs)}

# The engine options each command takes, as the README lists them.
LAYERS = {
    "model", "tokenizer", "dtype", "quantization", "gguf_dequantize", "device",
    "layer_impl", "custom_ops", "prepack_weights", "fp32_matmul_precision",
}  # fmt: skip
GENERATE = LAYERS | {
    "max_model_len", "kv_cache_memory", "kv_cache_dtype", "compile", "tensor_parallel_size", "pipeline_parallel_size",
}  # fmt: skip
SERVE = GENERATE | {"max_num_seqs", "data_parallel_size"}
COMMANDS = {
    "generate": (GENERATE, GENERATE_OPTIONS),
    "serve": (SERVE, SERVE_OPTIONS),
    "layers": (LAYERS | {"compile"}, LAYERS_OPTIONS),  # --compile: the report of the compiled pieces
}

# Where each config dataclass sits in an `EngineConfig`.
PARTS = {hint: name for name, hint in typing.get_type_hints(EngineConfig).items() if name.endswith("_config")}
# Options whose non-default value an `LLM` is not built with here: they start processes or compile (the
# tests of tensor/pipeline parallelism and of compilation build such LLMs); an LLM refuses data parallelism.
NOT_BUILT = {"compile", "tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"}


def _non_default(model: str) -> dict[str, tuple[Any, list[str]]]:
    """A value other than the default for every option, and the command line that gives it (none where no
    command takes the option)."""
    bundled = default_model()
    return {
        "model": (model, ["--model", model]),
        "tokenizer": (bundled, ["--tokenizer", bundled]),
        "dtype": ("bfloat16", ["--dtype", "bfloat16"]),
        "max_model_len": (64, ["--max-model-len", "64"]),
        "seed": (7, []),
        "skip_tokenizer_init": (True, []),
        "block_size": (32, []),
        "kv_cache_memory": (1 << 24, ["--kv-cache-memory", str(1 << 24)]),
        "kv_cache_dtype": ("float16", ["--kv-cache-dtype", "float16"]),
        "enable_prefix_caching": (False, []),
        "max_num_seqs": (8, ["--max-num-seqs", "8"]),
        "max_num_batched_tokens": (1024, []),
        "enable_chunked_prefill": (False, []),
        "device": ("cpu:0", ["--device", "cpu:0"]),
        "layer_impl": ("hw-agnostic", ["--layer-impl", "hw-agnostic"]),
        "custom_ops": (["none", "+rms_norm"], ["--custom-ops", "none,+rms_norm"]),
        "prepack_weights": (False, ["--no-prepack-weights"]),
        "fp32_matmul_precision": ("high", ["--fp32-matmul-precision", "high"]),
        "compile": (True, ["--compile"]),
        "compilation_config": ({"mode": "layer"}, []),
        "quantization": ("int8", ["--quantization", "int8"]),
        "gguf_dequantize": (True, ["--gguf-dequantize"]),
        "adaptive_threads": (False, []),
        "tensor_parallel_size": (2, ["-tp", "2"]),
        "pipeline_parallel_size": (2, ["--pipeline-parallel-size", "2"]),
        "data_parallel_size": (2, ["-dp", "2"]),
        "distributed_timeout": (30.0, []),
        "distributed_init_method": ("tcp://127.0.0.1:29555", []),
    }


def _value_in(config: EngineConfig, name: str) -> Any:
    """Where option `name` ends up in `config`."""
    if name == "compilation_config":
        return {"mode": config.compilation_config.mode}
    owner = FIELDS[name].metadata["config"]
    return getattr(config if owner is EngineConfig else getattr(config, PARTS[owner]), name)


def _comparable(config: EngineConfig) -> dict[str, Any]:
    """`config` by field, its model config without the HF config (which building the model annotates)."""
    model_config = config.model_config
    parts = {field.name: getattr(config, field.name) for field in fields(config)}
    parts["model_config"] = {
        f.name: getattr(model_config, f.name) for f in fields(model_config) if f.name != "hf_config"
    }
    return parts


def test_llm_takes_every_option_by_name_with_its_default_and_documents_it() -> None:
    parameters = list(inspect.signature(LLM.__init__).parameters.values())[1:]
    assert [parameter.name for parameter in parameters] == list(FIELDS)
    doc = " ".join(inspect.getdoc(LLM.__init__).split())
    for parameter in parameters:
        option = FIELDS[parameter.name]
        assert parameter.default == option.default, parameter.name
        assert parameter.kind is (
            parameter.POSITIONAL_OR_KEYWORD if parameter.name == "model" else parameter.KEYWORD_ONLY
        )
        assert f"{parameter.name}: {' '.join(option.metadata['help'].split())}" in doc


def test_defaults_are_the_config_dataclasses_own() -> None:
    for name, option in FIELDS.items():
        owner = option.metadata["config"]
        if name not in ("model", "compilation_config"):
            assert owner.__dataclass_fields__[name].default == option.default, name
    bare = EngineConfig(ModelConfig(default_model()))  # every config object built with no options
    assert EngineArgs().create_engine_config() == bare
    assert EngineArgs().create_engine_config().layer_config.custom_ops == LayerConfig().custom_ops == ["all"]


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_takes_its_options_with_the_same_defaults(command: str) -> None:
    expected, names = COMMANDS[command]
    assert set(names) == expected
    parsed = build_parser().parse_args([command])
    for name in names:
        assert getattr(parsed, name) == FIELDS[name].default, name
    assert EngineArgs.from_cli_args(parsed, names) == EngineArgs()


def test_a_value_reaches_the_same_config_through_every_route(
    tiny_model_dir: Callable[[str], Path],
) -> None:
    values = _non_default(str(tiny_model_dir("llama")))
    assert set(values) == set(FIELDS)
    for name, (value, _) in values.items():
        assert value != FIELDS[name].default, name
    config = EngineArgs(**{name: value for name, (value, _) in values.items()}).create_engine_config()
    for name, (value, _) in values.items():
        assert _value_in(config, name) == value, name

    for command, (expected, names) in COMMANDS.items():
        argv = [arg for name in expected for arg in values[name][1]]
        from_cli = EngineArgs.from_cli_args(build_parser().parse_args([command, *argv]), names)
        given = EngineArgs(**{name: values[name][0] for name in expected})
        assert from_cli == given, command
        assert from_cli.create_engine_config() == given.create_engine_config(), command

    built = {name: value for name, (value, _) in values.items() if name not in NOT_BUILT}
    llm = LLM(**built)
    try:
        assert _comparable(llm.engine.config) == _comparable(EngineArgs(**built).create_engine_config())
    finally:
        llm.shutdown()


def test_an_llm_is_one_engine() -> None:
    with pytest.raises(ConfigError, match="strata serve --data-parallel-size"):
        LLM(data_parallel_size=2)


def test_custom_ops_on_the_command_line_are_comma_separated() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, ["custom_ops"])
    assert parser.parse_args(["--custom-ops", " none, +rms_norm ,"]).custom_ops == ["none", "+rms_norm"]
    assert parser.parse_args([]).custom_ops == ("all",)
