"""The `strata` command line: `strata generate`, `convert`, `layers` and `serve`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from strata import __version__
from strata.engine_args import EngineArgs

# The engine options (`EngineArgs` fields) each command takes, in the order its help lists them.
MODEL_OPTIONS = ("model", "tokenizer", "dtype", "quantization", "gguf_dequantize", "device")
LAYER_OPTIONS = ("layer_impl", "custom_ops", "prepack_weights", "fp32_matmul_precision")
GENERATE_OPTIONS = (
    *MODEL_OPTIONS,
    "max_model_len",
    "kv_cache_memory",
    "kv_cache_dtype",
    "compile",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    *LAYER_OPTIONS,
)


def run_launched_rank(engine_args: EngineArgs, rank: int) -> int:
    """A rank past 0 of an engine torchrun launched: it builds its shard of the engine `engine_args`
    describe and runs the steps rank 0 (which serves or generates) sends it, until rank 0 stops."""
    from strata.worker.executor import executor_class
    from strata.worker.ranks import run_rank

    config = engine_args.create_engine_config()
    run_rank(executor_class(config.parallel_config), config, rank, "env://", None)  # type: ignore[arg-type]
    return 0


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    EngineArgs.add_cli_args(parser, GENERATE_OPTIONS)
    parser.add_argument("--prompt", default="Once upon a time", help="text to continue")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    parser.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from strata.distributed.parallel_state import torchrun_rank
    from strata.engine.llm_engine import LLMEngine
    from strata.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    engine_args = EngineArgs.from_cli_args(args, GENERATE_OPTIONS)
    if (launched := torchrun_rank()) is not None and launched[0] != 0:
        return run_launched_rank(engine_args, launched[0])
    engine = LLMEngine(engine_args.create_engine_config())
    try:
        request = engine.add_request(args.prompt, params)
        out = sys.stdout
        out.write(args.prompt)
        out.flush()
        printed = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id == request.request_id:
                    text = output.outputs[0].text
                    out.write(text[printed:])
                    out.flush()
                    printed = len(text)
        out.write("\n")
    finally:
        engine.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from strata.converters.cli import add_convert_parser
    from strata.entrypoints.layers_cli import add_layers_parser
    from strata.entrypoints.openai.cli_args import add_serve_parser

    parser = argparse.ArgumentParser(
        prog="strata", description="Strata: a hardware-agnostic LLM inference engine"
    )
    parser.add_argument("--version", action="version", version=f"strata {__version__}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        type=str.upper,
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Strata's log level; logs go to stderr",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate_parser(subparsers)
    add_convert_parser(subparsers)
    add_layers_parser(subparsers)
    add_serve_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # Strata reports its start-up (KV cache size, providers) at INFO; other libraries stay at WARNING.
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("strata").setLevel(args.log_level)
    try:
        return int(args.func(args))
    except (ValueError, TypeError, OSError) as exc:
        # User-caused errors (bad options, bad files, bad prompts) are one clear line, not a traceback.
        print(f"strata: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
