"""`strata serve`: its options, and building the engine and server from them.

The engine and FastAPI load on run, so `strata --help` stays fast (torch loads with the config classes).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from strata.engine_args import EngineArgs
from strata.entrypoints.cli import GENERATE_OPTIONS
from strata.entrypoints.openai.server_config import DEFAULT_MAX_SEQUENCES_PER_REQUEST

if TYPE_CHECKING:
    from strata.engine.engine_client import EngineClient

# The parsers of `tool_calls.TOOL_CALL_PARSERS`, named here so `strata --help` need not import the server.
TOOL_CALL_PARSER_NAMES = ("hermes", "json")
# `generate`'s engine options, the batch size and the replicas (`EngineArgs` fields).
SERVE_OPTIONS = (*GENERATE_OPTIONS, "max_num_seqs", "data_parallel_size")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="serve the OpenAI API (completions, chat, streaming) on HTTP; ready when /health is 200"
    )
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="model folder (same as --model)"
    )
    EngineArgs.add_cli_args(parser, SERVE_OPTIONS)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (not on /health)"
    )
    parser.add_argument(
        "--served-model-name", nargs="+", default=None, help="names clients use (default: the model)"
    )
    parser.add_argument("--chat-template", default=None, help="Jinja chat template file (or template text)")
    parser.add_argument(
        "--max-sequences-per-request",
        type=_positive_int,
        default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
        help="most sequences one request may ask for (its prompts x n); more is a 400",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSER_NAMES,
        default=None,
        help="how tool calls are found in a reply when tool_choice is auto: hermes (<tool_call>{...}</tool_call>) "
        "or json (the reply is a JSON call or list of calls); without it, tool_choice auto is a 400",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM's command lines: --tool-call-parser alone enables tool_choice auto",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted",
    )
    parser.set_defaults(func=run_serve)


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def _serving_engine(engine_args: EngineArgs) -> EngineClient:
    """One engine stepped on a thread of this process, or `--data-parallel-size` replicas of it, each in a
    process of its own."""
    from strata.engine.async_engine import AsyncLLMEngine
    from strata.engine.data_parallel import DataParallelEngine
    from strata.engine.llm_engine import LLMEngine

    config = engine_args.create_engine_config()
    if config.parallel_config.data_parallel_size == 1:
        return AsyncLLMEngine(LLMEngine(config))
    return DataParallelEngine(config)


def run_serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None and args.model is not None and args.model_tag != args.model:
        raise ValueError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    chat_template = _read_chat_template(args.chat_template)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or json)")

    import torch

    from strata import envs
    from strata.distributed.parallel_state import torchrun_rank
    from strata.entrypoints.cli import run_launched_rank
    from strata.entrypoints.llm import default_model
    from strata.entrypoints.openai.api_server import ServerConfig, run_server

    num_threads = envs.num_threads_default()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    model = args.model_tag or args.model
    engine_args = replace(EngineArgs.from_cli_args(args, SERVE_OPTIONS), model=model)
    if (launched := torchrun_rank()) is not None and args.data_parallel_size > 1:
        raise ValueError("--data-parallel-size starts its replicas itself: it does not combine with torchrun")
    if launched is not None and launched[0] != 0:
        # Another rank of a torchrun launch: rank 0 serves, this one runs its shard of each step.
        return run_launched_rank(engine_args, launched[0])
    engine = _serving_engine(engine_args)
    model_path = model if model is not None else default_model()
    names = args.served_model_name or [model if model is not None else Path(model_path).name]
    config = ServerConfig(
        model_path=model_path,
        model_names=names,
        api_key=args.api_key,
        chat_template=chat_template,
        max_sequences_per_request=args.max_sequences_per_request,
        tool_call_parser=args.tool_call_parser,
    )
    run_server(engine, config, args.host, args.port, args.shutdown_timeout)
    if engine.failure is not None:
        # Non-zero, so a supervisor restarts the server.
        print(
            f"strata: error: the server stopped because the engine failed: {engine.failure}", file=sys.stderr
        )
        return 1
    return 0
