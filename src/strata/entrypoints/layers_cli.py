"""`strata layers`: which implementation each layer of a model runs, (`--verify`) how far each replaced
layer's output is from its op's hw-agnostic reference, failing on a mismatch, and (`--compile`) what
Inductor made of each compiled piece: the ops it generated kernels for and the existing kernels it calls."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from strata.engine_args import EngineArgs
from strata.entrypoints.cli import LAYER_OPTIONS, MODEL_OPTIONS

if TYPE_CHECKING:
    from strata.engine.llm_engine import LLMEngine

LAYERS_OPTIONS = (*MODEL_OPTIONS, *LAYER_OPTIONS, "compile")


def add_layers_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("layers", help="show the implementation each layer of a model runs")
    EngineArgs.add_cli_args(parser, LAYERS_OPTIONS)
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


def _compiled_pieces(engine: LLMEngine) -> list[dict[str, Any]]:
    """One step of the compiled engine, so that its pieces exist, then a row per distinct piece."""
    from strata.sampling_params import SamplingParams

    engine.add_request({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    compiled = engine.runner.compiled
    assert compiled is not None
    rows = []
    for key, report in compiled.backend.piece_reports.items():
        # None: Inductor's provenance tracking switched off for this engine
        cells = report.cells() if report is not None else {"generated ops": "no record"}
        rows.append({"piece": key[:12], "kernels": "-", "extern calls": "-", **cells})
    return rows


def run_layers(args: argparse.Namespace) -> int:
    from strata.attention.backend import describe_attention
    from strata.custom_op import describe_layers, summarize_layers
    from strata.engine.llm_engine import LLMEngine
    from strata.models.transformers.layers import verify_attention, verify_layers
    from strata.models.transformers.loader import build_model

    # Without --compile only the model is built, not an engine; no tokenizer is needed either way.
    engine_args = replace(EngineArgs.from_cli_args(args, LAYERS_OPTIONS), skip_tokenizer_init=True)
    config = engine_args.create_engine_config()
    model_config = config.model_config
    platform = config.platform
    pieces = None
    if config.compilation_config.compile:
        engine = LLMEngine(config)
        pieces = _compiled_pieces(engine)
        model, specs, backend = engine.runner.model, engine.runner.layers, engine.runner.attn_backend
    else:
        platform.prepare()
        model, specs = build_model(model_config, config.layer_config, platform)
        model.to(config.torch_device)
        backend = platform.attention_backend(
            config.cache_config.cache_dtype(model_config.torch_dtype),
            reference=config.layer_config.use_hw_agnostic,
        )
    rows = describe_layers(model) + describe_attention([spec.name for spec in specs], backend)
    print(
        f"model: {model_config.model}  platform: {platform.name}  layer_impl: {config.layer_config.layer_impl}"
    )
    print(format_table(rows, ["module", "op", "provider", "class", "forward"]))
    print(f"total: {summarize_layers(rows)}")
    if pieces is not None:
        print("\ncompiled pieces: kernels Inductor generated (with the ops they compute) and extern calls")
        print(format_table(pieces, ["piece", "kernels", "generated ops", "extern calls"]))
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
