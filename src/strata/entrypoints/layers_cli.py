"""`strata layers`: which implementation each layer of a model runs, and (`--verify`) how far each replaced
layer's output is from its op's hw-agnostic reference, failing on a mismatch."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import torch

from strata.config import FP32_MATMUL_PRECISIONS, LAYER_IMPLS


def add_layer_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layer-impl",
        choices=LAYER_IMPLS,
        default=None,
        help="layer implementations (default: hw-agnostic when STRATA_USE_HW_AGNOSTIC=1, else default)",
    )
    parser.add_argument(
        "--custom-ops",
        default=None,
        help="comma-separated custom_ops setting, e.g. 'all,-silu_and_mul' or 'none,+rms_norm' (default: all)",
    )
    parser.add_argument(
        "--prepack-weights",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="replace float32 CPU linear weights by Strata's GEMM panels after loading (AVX-512 builds), read "
        "at every batch size; each weight is still held once (default: STRATA_PREPACK_WEIGHTS, on)",
    )
    parser.add_argument(
        "--fp32-matmul-precision",
        choices=FP32_MATMUL_PRECISIONS,
        default=None,
        help="torch.set_float32_matmul_precision for packing float32 weights: 'high' multiplies them as bf16x3 "
        "on CPUs with AMX, at every row count (default: torch's own setting, 'highest' unless changed)",
    )


def layer_config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM`/`LayerConfig` keyword arguments from the options `add_layer_arguments` added."""
    kwargs: dict[str, Any] = {"layer_impl": args.layer_impl}
    if args.custom_ops is not None:
        kwargs["custom_ops"] = [op.strip() for op in args.custom_ops.split(",") if op.strip()]
    if args.prepack_weights is not None:
        kwargs["prepack_weights"] = args.prepack_weights
    if args.fp32_matmul_precision is not None:
        kwargs["fp32_matmul_precision"] = args.fp32_matmul_precision
    return kwargs


def add_layers_parser(subparsers: argparse._SubParsersAction) -> None:
    from strata.entrypoints.cli import add_model_arguments

    parser = subparsers.add_parser("layers", help="show the implementation each layer of a model runs")
    add_model_arguments(parser)
    add_layer_arguments(parser)
    parser.add_argument(
        "--verify",
        action="store_true",
        help="compare each replaced layer with its op's hw-agnostic reference; exit 1 on a mismatch",
    )
    parser.set_defaults(func=run_layers)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    widths = [max([len(c), *(len(str(row[c])) for row in rows)]) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)) for row in rows]
    return "\n".join(lines)


# A replaced layer agrees with its reference when no output differs by more than this: float32 rounding of
# another summation order, and bf16x3's rounding where float32 weights are packed at "high" precision.
VERIFY_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def run_layers(args: argparse.Namespace) -> int:
    from strata.attention.backend import describe_attention
    from strata.config import EngineConfig, LayerConfig, ModelConfig
    from strata.custom_op import describe_layers, summarize_layers
    from strata.entrypoints.llm import default_model
    from strata.models.transformers.layers import verify_attention, verify_layers
    from strata.models.transformers.loader import build_model

    model_config = ModelConfig(
        model=args.model or default_model(),
        dtype=args.dtype,
        skip_tokenizer_init=True,
        quantization=args.quantization,
        gguf_dequantize=args.gguf_dequantize,
    )
    config = EngineConfig(
        model_config, layer_config=LayerConfig(**layer_config_kwargs(args)), device=args.device
    )
    platform = config.platform
    platform.prepare()
    model, specs = build_model(model_config, config.layer_config, platform)
    model.to(config.torch_device)
    backend = platform.attention_backend(config.cache_config.cache_dtype(model_config.torch_dtype))
    rows = describe_layers(model) + describe_attention([spec.name for spec in specs], backend)
    print(
        f"model: {model_config.model}  platform: {platform.name}  layer_impl: {config.layer_config.layer_impl}"
    )
    print(format_table(rows, ["module", "op", "provider", "class", "forward"]))
    print(f"total: {summarize_layers(rows)}")
    if not args.verify:
        return 0
    checks = [*verify_layers(model), verify_attention(backend, specs, model_config.torch_dtype)]
    tolerance = VERIFY_TOLERANCE.get(model_config.torch_dtype, 1e-3)
    mismatched = [check["op"] for check in checks if check["max_abs_diff"] > tolerance]
    for check in checks:
        check["max_abs_diff"] = f"{check['max_abs_diff']:.3g}"
    print()
    print(format_table(checks, ["op", "modules", "max_abs_diff", "reference"]))
    if mismatched:
        print(f"\nmismatch: {', '.join(mismatched)} differ from their reference by more than {tolerance:g}")
        return 1
    return 0
