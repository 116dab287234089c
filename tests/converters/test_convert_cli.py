"""`strata convert ...` through the argparse registration the main CLI uses."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from safetensors.numpy import load_file

from strata.converters import ConversionError
from strata.converters.cli import add_convert_parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="strata")
    add_convert_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_convert_llama2c_and_gguf(
    shared_models_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    bin_out, gguf_out = tmp_path / "from_bin", tmp_path / "from_gguf"
    args = parse(
        [
            "convert", "llama2c", str(shared_models_dir / "stories260K.bin"),
            "--tokenizer", str(shared_models_dir / "tok512.bin"), "--out", str(bin_out),
        ]
    )  # fmt: skip
    assert (args.command, args.format) == ("convert", "llama2c")
    assert args.func(args) == 0
    args = parse(["convert", "gguf", str(shared_models_dir / "stories260K.gguf"), "--out", str(gguf_out)])
    assert args.func(args) == 0
    assert f"wrote {gguf_out}" in capsys.readouterr().out
    from_bin, from_gguf = load_file(bin_out / "model.safetensors"), load_file(gguf_out / "model.safetensors")
    assert from_bin.keys() == from_gguf.keys()

    # Converting again into the same folder needs --force.
    args = parse(["convert", "gguf", str(shared_models_dir / "stories260K.gguf"), "--out", str(gguf_out)])
    with pytest.raises(ConversionError, match="not empty"):
        args.func(args)
    args = parse(
        ["convert", "gguf", str(shared_models_dir / "stories260K.gguf"), "--out", str(gguf_out), "--force"]
    )
    assert args.func(args) == 0


def test_usage_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(["convert", "llama2c", "model.bin", "--out", str(tmp_path)])  # no --tokenizer
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit):
        parse(["convert"])  # no format
    args = parse(["convert", "gguf", str(tmp_path / "missing.gguf"), "--out", str(tmp_path / "out")])
    with pytest.raises(ConversionError, match=r"missing\.gguf: GGUF file not found"):
        args.func(args)
