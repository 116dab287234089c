"""Bad GGUF files get one clear error naming the file and the problem, never a numpy or struct traceback;
types Strata does not compute on are refused by name, or dequantized where the user asks for it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from transformers import LlamaConfig

from strata import LLM
from strata.gguf.file import GGUFError

from gguf_models import write_tiny_gguf

TENSOR = "blk.0.ffn_down.weight"


def _config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def good_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gguf(_config(), tmp_path_factory.mktemp("good") / "tiny.gguf")


def _load(path: Path, **kwargs) -> LLM:
    return LLM(str(path), skip_tokenizer_init=True, max_model_len=64, compile=False, **kwargs)


@pytest.mark.parametrize(
    ("cut", "message"),
    [(10, "truncated"), (200, "truncated"), (0.6, "truncated"), (0.99, "truncated")],
)
def test_truncated_file(good_file: Path, tmp_path: Path, cut: float, message: str) -> None:
    data = good_file.read_bytes()
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(data[: int(cut if cut >= 1 else len(data) * cut)])
    with pytest.raises(GGUFError, match=rf"cut\.gguf.*{message}"):
        _load(bad)


def test_not_a_gguf_file(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match=r"model\.gguf: not a GGUF file"):
        _load(bad)


def test_unknown_architecture(tmp_path: Path) -> None:
    path = tmp_path / "odd.gguf"
    writer = GGUFWriter(path, "frobnicator")
    writer.add_block_count(2)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        GGUFError, match=r"odd\.gguf: architecture 'frobnicator' is not one transformers reads"
    ):
        _load(path)


def test_unsupported_type_is_named_or_dequantized(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write_tiny_gguf(
        _config(), tmp_path / "iq.gguf", random_blocks={TENSOR: GGMLQuantizationType.IQ4_NL}
    )
    with pytest.raises(GGUFError, match=rf"iq\.gguf: tensor '{TENSOR}' has GGUF type IQ4_NL"):
        _load(path)
    with caplog.at_level(logging.WARNING, logger="strata.models.gguf"):
        llm = _load(path, gguf_dequantize=True)
    assert f"tensor '{TENSOR}' has GGUF type IQ4_NL" in caplog.text
    down = llm.engine.runner.model.get_submodule("model.layers.0.mlp.down_proj")
    assert not hasattr(down, "qweight")  # a dense layer now


def test_tokenizer_that_cannot_be_built(tmp_path: Path, good_file: Path) -> None:
    path = tmp_path / "notok.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tokenizer_model("no-such-tokenizer")
    writer.add_token_list(["a", "b"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from strata.engine.llm_engine import load_tokenizer

    with pytest.raises(ValueError, match=r"notok\.gguf.*tokenizer"):
        load_tokenizer(str(path))


def test_cli_reports_a_bad_file_in_one_line(tmp_path: Path, good_file: Path) -> None:
    bad = tmp_path / "half.gguf"
    bad.write_bytes(good_file.read_bytes()[: good_file.stat().st_size // 2])
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata",
            "generate",
            "--model",
            str(bad),
            "--prompt",
            "hi",
            "--max-tokens",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    assert "half.gguf is truncated" in result.stderr
