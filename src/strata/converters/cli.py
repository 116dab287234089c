"""`strata convert llama2c ...` and `strata convert gguf ...`: registered on the main CLI's subparsers."""

from __future__ import annotations

import argparse

from strata.converters.llama2c import convert_llama2c
from strata.gguf.converter import convert_gguf


def _run_llama2c(args: argparse.Namespace) -> int:
    out = convert_llama2c(args.checkpoint, args.tokenizer, args.out, overwrite=args.force)
    print(f"wrote {out}")
    return 0


def _run_gguf(args: argparse.Namespace) -> int:
    out = convert_gguf(args.file, args.out, overwrite=args.force, keep_quantized=args.keep_quantized)
    print(f"wrote {out}")
    return 0


def add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `convert` with one sub-command per source format; each sets `func(args) -> exit code`."""
    convert = subparsers.add_parser(
        "convert", help="convert a llama2.c or GGUF model to a Hugging Face folder"
    )
    formats = convert.add_subparsers(dest="format", metavar="FORMAT", required=True)

    llama2c = formats.add_parser("llama2c", help="llama2.c checkpoint (legacy v0 float32) and tokenizer.bin")
    llama2c.add_argument("checkpoint", help="the .bin checkpoint")
    llama2c.add_argument("--tokenizer", required=True, help="llama2.c tokenizer.bin (e.g. tok512.bin)")
    llama2c.set_defaults(func=_run_llama2c)

    gguf = formats.add_parser(
        "gguf", help="GGUF file of any architecture transformers reads, dequantized to float32"
    )
    gguf.add_argument("file", help="the .gguf file")
    gguf.add_argument(
        "--keep-quantized",
        action="store_true",
        help="keep Q8_0 weights as int8 with their block scales (a quarter of float32's size; Strata loads "
        "the folder with --quantization int8, plain transformers cannot); default: float32, like the source",
    )
    gguf.set_defaults(func=_run_gguf)

    for parser in (llama2c, gguf):
        parser.add_argument(
            "--out", required=True, help="output folder (created; must be empty unless --force)"
        )
        parser.add_argument("--force", action="store_true", help="write into a non-empty output folder")
