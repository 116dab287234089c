"""llama2.c conversion: the bundled folder is what the converter produces, and damaged inputs fail clearly."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from strata.bundled import BUNDLED_MODEL_DIR, default_model
from strata.converters import ConversionError, convert_llama2c


def write_bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_bundled_folder_is_the_converters_output(llama2c_folder: Path) -> None:
    assert Path(default_model()) == BUNDLED_MODEL_DIR
    written = sorted(p.name for p in llama2c_folder.iterdir())
    assert written == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
    ]  # fmt: skip
    for name in written:
        assert (BUNDLED_MODEL_DIR / name).read_bytes() == (llama2c_folder / name).read_bytes(), name
    assert "MIT" in (BUNDLED_MODEL_DIR / "README.md").read_text(encoding="utf-8")


def test_config_and_tensors(llama2c_folder: Path, shared_models_dir: Path) -> None:
    config = json.loads((llama2c_folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]) == (64, 172, 5)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (8, 4, 8)
    assert (config["vocab_size"], config["max_position_embeddings"]) == (512, 512)
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["rms_norm_eps"] == 1e-5

    tensors = load_file(llama2c_folder / "model.safetensors")
    assert "lm_head.weight" not in tensors
    assert len(tensors) == 2 + 5 * 9
    assert all(t.dtype == np.float32 for t in tensors.values())
    # Spot-check placement against the raw file: the embedding starts right after the header, and the
    # interleaved (x0, y0, x1, y1) rows of layer 0's wq become (x0, x1, ..., y0, y1, ...) per head.
    raw = np.fromfile(shared_models_dir / "stories260K.bin", dtype="<f4", offset=28)
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], raw[: 512 * 64].reshape(512, 64))
    wq0 = raw[512 * 64 + 5 * 64 :][: 64 * 64].reshape(64, 64)
    q = tensors["model.layers.0.self_attn.q_proj.weight"]
    np.testing.assert_array_equal(q[0:4], wq0[0:8:2])
    np.testing.assert_array_equal(q[4:8], wq0[1:8:2])
    np.testing.assert_array_equal(q[8:12], wq0[8:16:2])


def test_truncated_checkpoint(shared_models_dir: Path, tmp_path: Path) -> None:
    data = (shared_models_dir / "stories260K.bin").read_bytes()
    for size in (len(data) - 4, len(data) // 2, 100):
        bad = write_bytes(tmp_path / f"cut{size}.bin", data[:size])
        with pytest.raises(ConversionError, match=rf"cut{size}\.bin is truncated.*1056540 bytes.*has {size}"):
            convert_llama2c(bad, shared_models_dir / "tok512.bin", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_too_short_checkpoint(shared_models_dir: Path, tmp_path: Path) -> None:
    for data in (b"", b"\x01\x02\x03"):
        bad = write_bytes(tmp_path / "short.bin", data)
        with pytest.raises(ConversionError, match=r"short\.bin: \d+ bytes is too short"):
            convert_llama2c(bad, shared_models_dir / "tok512.bin", tmp_path / "out")


def test_header_that_does_not_match_the_file(shared_models_dir: Path, tmp_path: Path) -> None:
    data = (shared_models_dir / "stories260K.bin").read_bytes()
    longer = write_bytes(tmp_path / "longer.bin", data + b"\0" * 8)
    with pytest.raises(ConversionError, match=r"header that does not match the file size.*has 1056548"):
        convert_llama2c(longer, shared_models_dir / "tok512.bin", tmp_path / "out")
    # n_layers 4 instead of 5: the sizes no longer add up to the file.
    wrong = write_bytes(tmp_path / "wrong.bin", data[:8] + struct.pack("<i", 4) + data[12:])
    with pytest.raises(ConversionError, match=r"wrong\.bin has a header that does not match"):
        convert_llama2c(wrong, shared_models_dir / "tok512.bin", tmp_path / "out")
    # A negative vocab_size announces a separate classifier, which this file does not have.
    unshared = write_bytes(tmp_path / "unshared.bin", data[:20] + struct.pack("<i", -512) + data[24:])
    with pytest.raises(ConversionError, match=r"unshared\.bin is truncated"):
        convert_llama2c(unshared, shared_models_dir / "tok512.bin", tmp_path / "out")


def test_nonsense_header_values(shared_models_dir: Path, tmp_path: Path) -> None:
    data = (shared_models_dir / "stories260K.bin").read_bytes()
    zero_heads = write_bytes(tmp_path / "zero.bin", data[:12] + struct.pack("<i", 0) + data[16:])
    with pytest.raises(ConversionError, match=r"zero\.bin: not a llama2\.c v0 checkpoint.*'n_heads': 0"):
        convert_llama2c(zero_heads, shared_models_dir / "tok512.bin", tmp_path / "out")
    with pytest.raises(ConversionError, match=r"stories260K\.gguf is a GGUF file.*strata convert gguf"):
        convert_llama2c(
            shared_models_dir / "stories260K.gguf", shared_models_dir / "tok512.bin", tmp_path / "out"
        )
    odd_kv = write_bytes(tmp_path / "kv.bin", data[:16] + struct.pack("<i", 3) + data[20:])
    with pytest.raises(ConversionError, match=r"8 attention heads are not a multiple of 3 KV heads"):
        convert_llama2c(odd_kv, shared_models_dir / "tok512.bin", tmp_path / "out")
    versioned = write_bytes(tmp_path / "v1.bin", struct.pack("<Ii", 0x616B3432, 1) + data[8:])
    with pytest.raises(ConversionError, match=r"v1\.bin: this is a versioned llama2\.c export"):
        convert_llama2c(versioned, shared_models_dir / "tok512.bin", tmp_path / "out")


def test_separate_classifier_becomes_lm_head(shared_models_dir: Path, tmp_path: Path) -> None:
    data = (shared_models_dir / "stories260K.bin").read_bytes()
    classifier = np.arange(512 * 64, dtype="<f4").reshape(512, 64) / 1000
    unshared = data[:20] + struct.pack("<i", -512) + data[24:] + classifier.tobytes()
    out = convert_llama2c(
        write_bytes(tmp_path / "unshared.bin", unshared), shared_models_dir / "tok512.bin", tmp_path / "out"
    )
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    np.testing.assert_array_equal(load_file(out / "model.safetensors")["lm_head.weight"], classifier)


def test_bad_tokenizer_files(shared_models_dir: Path, tmp_path: Path) -> None:
    checkpoint = shared_models_dir / "stories260K.bin"
    tok = (shared_models_dir / "tok512.bin").read_bytes()
    with pytest.raises(ConversionError, match=r"cut\.bin is truncated"):
        convert_llama2c(checkpoint, write_bytes(tmp_path / "cut.bin", tok[:-3]), tmp_path / "out")
    # Drop the last piece (float32 score, int32 length, 3 bytes of U+200A): 511 pieces for a 512-token model.
    with pytest.raises(
        ConversionError, match=r"short\.bin: tokenizer has 511 pieces but .* vocabulary of 512"
    ):
        convert_llama2c(checkpoint, write_bytes(tmp_path / "short.bin", tok[:-11]), tmp_path / "out")
    with pytest.raises(ConversionError, match=r"missing\.bin: cannot read the tokenizer"):
        convert_llama2c(checkpoint, tmp_path / "missing.bin", tmp_path / "out")
    with pytest.raises(ConversionError, match=r"nope\.bin: checkpoint file not found"):
        convert_llama2c(tmp_path / "nope.bin", shared_models_dir / "tok512.bin", tmp_path / "out")


def test_refuses_to_overwrite_a_non_empty_folder(shared_models_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    sources = (shared_models_dir / "stories260K.bin", shared_models_dir / "tok512.bin")
    with pytest.raises(ConversionError, match=r"output folder is not empty"):
        convert_llama2c(*sources, out)
    convert_llama2c(*sources, out, overwrite=True)
    assert (out / "keep.txt").read_text() == "mine"
    assert (out / "model.safetensors").is_file()
