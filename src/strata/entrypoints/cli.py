"""The `strata` command line: `strata generate`, `strata convert` and `strata serve`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from strata import __version__
from strata.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from strata.entrypoints.layers_cli import add_layer_arguments, add_layers_parser, layer_config_kwargs


def add_quantization_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="int8: weight-only int8 Linear layers, quantized per channel at load (default: off, or what "
        "the model folder was stored as)",
    )


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """What to load and where: the model, its dtype and quantization, the device."""
    parser.add_argument(
        "--model",
        default=None,
        help="local model folder or .gguf file (default: the bundled stories260K)",
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    add_quantization_argument(parser)
    parser.add_argument(
        "--gguf-dequantize",
        action="store_true",
        help="dequantize GGUF tensors of types Strata does not compute on (IQ*, TQ*) at load, with a "
        "warning, instead of refusing the file",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="the platform to run on: cpu, cuda, cuda:N, or a plugin's platform (default: cpu)",
    )


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """`add_model_arguments`, the cache and compilation options, and the layer options."""
    add_model_arguments(parser)
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes for the KV cache")
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="dtype the KV cache stores keys and values in (default: auto, the model's dtype)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the model forward, piecewise (default: STRATA_COMPILE, off)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="processes the model is sharded over, each with its share of the cores (default: 1)",
    )
    parser.add_argument(
        "--pipeline-parallel-size",
        "-pp",
        type=int,
        default=1,
        help="pipeline stages the decoder layers are split over, a process each (default: 1)",
    )
    add_layer_arguments(parser)


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `LLM` options of `add_engine_arguments`."""
    return {
        "dtype": args.dtype,
        "device": args.device,
        "max_model_len": args.max_model_len,
        "kv_cache_memory": args.kv_cache_memory,
        "kv_cache_dtype": args.kv_cache_dtype,
        "compile": args.compile,
        "quantization": args.quantization,
        "tokenizer": args.tokenizer,
        "gguf_dequantize": args.gguf_dequantize,
        "tensor_parallel_size": args.tensor_parallel_size,
        "pipeline_parallel_size": args.pipeline_parallel_size,
        **layer_config_kwargs(args),
    }


def llm_from_args(args: argparse.Namespace, model: str | None, **options: Any) -> Any:
    """The `LLM` the options of `add_engine_arguments` ask for (`options` add to them)."""
    from strata.entrypoints.llm import LLM

    return LLM(model, **engine_options(args), **options)


def run_launched_rank(args: argparse.Namespace, rank: int, model: str | None, **options: Any) -> int:
    """A rank past 0 of an engine torchrun launched: it builds its shard of the engine `args` describe
    and runs the steps rank 0 (which serves or generates) sends it, until rank 0 stops."""
    from strata.entrypoints.llm import engine_config
    from strata.worker.executor import executor_class
    from strata.worker.ranks import run_rank

    config = engine_config(model, **engine_options(args), **options)
    run_rank(executor_class(config.parallel_config), config, rank, "env://", None)  # type: ignore[arg-type]
    return 0


def _add_generate_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate text from a prompt, streamed to the terminal")
    add_engine_arguments(parser)
    parser.add_argument("--prompt", default="Once upon a time", help="text to continue")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="seed of this request's sampling")
    parser.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from strata.distributed.parallel_state import torchrun_rank
    from strata.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    if (launched := torchrun_rank()) is not None and launched[0] != 0:
        return run_launched_rank(args, launched[0], args.model)
    engine = llm_from_args(args, args.model).engine
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
