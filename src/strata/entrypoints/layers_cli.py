"""`strata layers`: which implementation each replaced layer of a model uses, and (`--verify`) how far
each op's output is from the hw-agnostic reference."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

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
        help="keep a second copy of CPU linear weights packed for prefill and batches (float32 on AVX-512: "
        "Strata's panels, from 4 rows or for weights of 1 MB; else oneDNN's layout, over 8 rows): faster "
        "there, twice the linear weights' memory (default: STRATA_PREPACK_WEIGHTS, on)",
    )
    parser.add_argument(
        "--fp32-matmul-precision",
        choices=FP32_MATMUL_PRECISIONS,
        default=None,
        help="torch.set_float32_matmul_precision for packing float32 weights: 'high' multiplies them as bf16x3 "
        "on CPUs with AMX, from 4 rows of x on (default: torch's own setting, 'highest' unless changed)",
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
    from strata.entrypoints.cli import add_quantization_argument

    parser = subparsers.add_parser("layers", help="show the layer implementation each replaced module uses")
    parser.add_argument("--model", default=None, help="local model folder (default: the bundled stories260K)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    add_quantization_argument(parser)
    add_layer_arguments(parser)
    parser.add_argument(
        "--verify", action="store_true", help="compare each op with the hw-agnostic forward_native"
    )
    parser.set_defaults(func=run_layers)


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str]) -> str:
    widths = [max([len(c), *(len(str(row[c])) for row in rows)]) for c in columns]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def run_layers(args: argparse.Namespace) -> int:
    from strata.config import LayerConfig, ModelConfig
    from strata.custom_op import describe_layers, summarize_layers
    from strata.entrypoints.llm import default_model
    from strata.models.transformers.layers import verify_layers
    from strata.models.transformers.loader import build_model

    model_config = ModelConfig(
        model=args.model or default_model(),
        dtype=args.dtype,
        skip_tokenizer_init=True,
        quantization=args.quantization,
    )
    layer_config = LayerConfig(**layer_config_kwargs(args))
    model, _ = build_model(model_config, layer_config)
    rows = describe_layers(model)
    print(f"model: {model_config.model}  layer_impl: {layer_config.layer_impl}")
    print(format_table(rows, ["module", "op", "provider", "class", "forward"]))
    print(f"total: {summarize_layers(rows)}")
    if args.verify:
        checks = verify_layers(model)
        for check in checks:
            diff = check["max_abs_diff"]
            check["max_abs_diff"] = "no reference" if diff is None else f"{diff:.3g}"
        print()
        print(format_table(checks, ["op", "modules", "max_abs_diff", "reference"]))
    return 0
