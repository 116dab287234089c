"""GGUF conversion: same model as the llama2.c source, F16/BF16/Q8_0 within their precision, any other
architecture or type exactly as transformers loads it, clear errors."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import quantize
from safetensors.numpy import load_file
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

from strata.converters import ConversionError
from strata.gguf.converter import convert_gguf

from gguf_models import write_tiny_gguf
from tiny_models import TINY_CONFIGS

F32, F16, BF16, Q8_0 = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
)


def write_gguf(
    path: Path,
    source: Path,
    qtype: Callable[[str, np.ndarray], GGMLQuantizationType] = lambda name, data: F32,
    *,
    arch: str = "llama",
    drop: tuple[str, ...] = (),
    replace: dict[str, np.ndarray] | None = None,
    pad_id: int | None = None,
    skip_rms_eps: bool = False,
) -> Path:
    """A GGUF like llama.cpp writes it, from the F32 tensors and tokenizer of the shared stories260K.gguf."""
    reader = GGUFReader(source)
    writer = GGUFWriter(path, arch)
    writer.add_context_length(512)
    writer.add_embedding_length(64)
    writer.add_block_count(5)
    writer.add_feed_forward_length(172)
    writer.add_head_count(8)
    writer.add_head_count_kv(4)
    writer.add_rope_dimension_count(8)
    writer.add_rope_freq_base(10000.0)
    if not skip_rms_eps:
        writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(reader.fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_scores(reader.fields["tokenizer.ggml.scores"].contents())
    writer.add_token_types(reader.fields["tokenizer.ggml.token_type"].contents())
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    if pad_id is not None:
        writer.add_pad_token_id(pad_id)
    for tensor in reader.tensors:
        if tensor.name in drop:
            continue
        data = (replace or {}).get(tensor.name, np.array(tensor.data, dtype=np.float32))
        kind = qtype(tensor.name, data)
        if kind == F32:
            writer.add_tensor(tensor.name, data)
        else:
            writer.add_tensor(tensor.name, quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def matrices_as(kind: GGMLQuantizationType) -> Callable[[str, np.ndarray], GGMLQuantizationType]:
    """llama.cpp's choice: norms stay F32, and Q8_0 only where rows fill whole 32-value blocks."""

    def choose(name: str, data: np.ndarray) -> GGMLQuantizationType:
        if data.ndim != 2 or (kind == Q8_0 and data.shape[-1] % 32):
            return F32
        return kind

    return choose


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 -> float32, round to nearest even (no NaNs in these weights)."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32)


def test_shared_gguf_gives_the_llama2c_model(gguf_folder: Path, llama2c_folder: Path) -> None:
    ours, theirs = (
        load_file(gguf_folder / "model.safetensors"),
        load_file(llama2c_folder / "model.safetensors"),
    )
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    # The file stores output.weight as an exact copy of token_embd.weight: converted as tied.
    config, reference = (json.loads((d / "config.json").read_text()) for d in (gguf_folder, llama2c_folder))
    assert config.pop("max_position_embeddings") == 2048  # what that file's metadata says
    reference.pop("max_position_embeddings")
    assert config == reference
    # Same tokenizer; the file's pad id 4294967295 (-1) is outside the vocabulary and ignored.
    assert (gguf_folder / "tokenizer.json").read_bytes() == (llama2c_folder / "tokenizer.json").read_bytes()
    assert "pad_token" not in json.loads((gguf_folder / "tokenizer_config.json").read_text())
    tokenizer = Tokenizer.from_file(str(gguf_folder / "tokenizer.json"))
    assert tokenizer.encode("Once upon a time").ids == [1, 403, 407, 261, 378]


@pytest.mark.parametrize("kind", [F16, BF16, Q8_0], ids=lambda k: k.name)
def test_quantised_tensors(kind: GGMLQuantizationType, shared_models_dir: Path, llama2c_folder: Path,
                           tmp_path: Path) -> None:  # fmt: skip
    source = shared_models_dir / "stories260K.gguf"
    embedding = np.array(GGUFReader(source).get_tensor(0).data)
    options: dict = {
        F16: {"drop": ("output.weight",)},  # no output.weight: tied
        BF16: {"pad_id": 0},  # output.weight an exact copy of the embedding: tied
        Q8_0: {"replace": {"output.weight": embedding * 0.5}},  # a real separate classifier
    }[kind]
    path = write_gguf(tmp_path / f"model-{kind.name}.gguf", source, matrices_as(kind), **options)
    assert {t.tensor_type for t in GGUFReader(path).tensors} == {F32, kind}
    out = convert_gguf(path, tmp_path / "out")

    converted = load_file(out / "model.safetensors")
    exact = load_file(llama2c_folder / "model.safetensors")
    if kind == Q8_0:
        exact["lm_head.weight"] = exact["model.embed_tokens.weight"] * 0.5
    assert sorted(converted) == sorted(exact)
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is (kind != Q8_0)
    for name, want in exact.items():
        got = converted[name]
        assert got.dtype == np.float32 and got.shape == want.shape, name
        if want.ndim == 1 or (kind == Q8_0 and want.shape[-1] % 32):
            np.testing.assert_array_equal(got, want, err_msg=name)  # stayed F32
        elif kind == F16:
            np.testing.assert_array_equal(got, want.astype(np.float16).astype(np.float32), err_msg=name)
        elif kind == BF16:
            np.testing.assert_array_equal(got, bf16_round(want), err_msg=name)
        else:
            # Q8_0: blocks of 32 along each row, scale d = max|x| / 127 stored as float16, values rounded to
            # d * int8. The error bound is d/2 plus the scale's float16 rounding; row reordering keeps blocks.
            blocks, got_blocks = want.reshape(-1, 32), got.reshape(-1, 32)
            bound = np.abs(blocks).max(axis=1, keepdims=True) / 127 * 0.6 + 1e-12
            assert np.all(np.abs(got_blocks - blocks) <= bound), name
            assert not np.array_equal(got, want), name
    if kind == BF16:
        assert config["pad_token_id"] == 0
        assert json.loads((out / "tokenizer_config.json").read_text())["pad_token"] == "<unk>"


def test_other_types_convert_through_transformers(shared_models_dir: Path, tmp_path: Path) -> None:
    """A type the Llama writer does not take (Q4_0) sends the file through transformers: the folder holds
    exactly the weights transformers' own GGUF loader dequantizes."""

    def q4_for_wq(name: str, data: np.ndarray) -> GGMLQuantizationType:
        return GGMLQuantizationType.Q4_0 if name == "blk.3.attn_q.weight" else F32

    path = write_gguf(tmp_path / "q4.gguf", shared_models_dir / "stories260K.gguf", q4_for_wq)
    _assert_same_as_transformers(convert_gguf(path, tmp_path / "out"), path)


# A K-quant tensor per file, where rows are whole 256-weight super-blocks.
K_QUANT_TENSORS = {
    "gemma3": {
        "blk.0.ffn_down.weight": GGMLQuantizationType.Q4_K,
        "blk.1.ffn_down.weight": GGMLQuantizationType.Q6_K,
    },
    "gpt2": {"blk.0.ffn_down.weight": GGMLQuantizationType.Q5_K},
    "qwen2_moe": {"blk.0.ffn_down_shexp.weight": GGMLQuantizationType.Q3_K},
}


@pytest.mark.parametrize("arch", sorted(K_QUANT_TENSORS))
def test_any_architecture_converts(arch: str, tmp_path: Path) -> None:
    config = TINY_CONFIGS[arch]()
    if arch == "gpt2":
        config.n_positions = 1024  # what a GGUF file's gpt2 metadata leads transformers to
        config.n_inner = 256
    elif arch == "qwen2_moe":  # sizes qwen2moe metadata has no key for: the config's defaults
        defaults = type(config)()
        config.moe_intermediate_size = defaults.moe_intermediate_size
        config.shared_expert_intermediate_size = defaults.shared_expert_intermediate_size
    else:
        config.intermediate_size = 256
    path = write_tiny_gguf(
        config,
        tmp_path / f"{arch}.gguf",
        qtype=GGMLQuantizationType.Q5_1,
        random_blocks=K_QUANT_TENSORS[arch],
    )
    _assert_same_as_transformers(convert_gguf(path, tmp_path / "out"), path)


def _assert_same_as_transformers(folder: Path, path: Path) -> None:
    ours = AutoModelForCausalLM.from_pretrained(folder)
    theirs = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    want = theirs.state_dict()
    for name, tensor in ours.state_dict().items():
        torch.testing.assert_close(tensor, want[name], rtol=0, atol=0, msg=name)
    assert AutoTokenizer.from_pretrained(folder) is not None


def test_unknown_tensor_type_id(shared_models_dir: Path, tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "odd.gguf", shared_models_dir / "stories260K.gguf")
    field = GGUFReader(path).tensors[0].field
    type_offset = field.offset + sum(int(part.nbytes) for part in field.parts[:4])
    data = bytearray(path.read_bytes())
    assert struct.unpack_from("<I", data, type_offset)[0] == int(F32)
    struct.pack_into("<I", data, type_offset, 250)
    path.write_bytes(bytes(data))
    with pytest.raises(
        ConversionError, match=r"odd\.gguf: tensor 'token_embd\.weight' has unknown GGML type id 250"
    ):
        convert_gguf(path, tmp_path / "out")


def test_truncated_gguf(shared_models_dir: Path, tmp_path: Path) -> None:
    data = (shared_models_dir / "stories260K.gguf").read_bytes()
    for size in (len(data) - 10, len(data) // 2, 1000, 100, 30, 10, 3, 0):
        path = tmp_path / f"cut{size}.gguf"
        path.write_bytes(data[:size])
        with pytest.raises(ConversionError, match=rf"cut{size}\.gguf.*truncated") as info:
            convert_gguf(path, tmp_path / "out")
        assert "Traceback" not in str(info.value)
    last = (
        r"tensor 'blk\.4\.ffn_norm\.weight' \(F32, shape \[64\]\) ends at byte 1185376, the file has 1185366"
    )
    with pytest.raises(ConversionError, match=last):
        convert_gguf(tmp_path / f"cut{len(data) - 10}.gguf", tmp_path / "out")


def test_not_a_gguf(shared_models_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "magic.gguf"
    path.write_bytes(b"XXXX" + (shared_models_dir / "stories260K.gguf").read_bytes()[4:])
    with pytest.raises(
        ConversionError, match=r"magic\.gguf: not a GGUF file \(expected magic b'GGUF', found b'XXXX'\)"
    ):
        convert_gguf(path, tmp_path / "out")
    with pytest.raises(ConversionError, match=r"stories260K\.bin: not a GGUF file"):
        convert_gguf(shared_models_dir / "stories260K.bin", tmp_path / "out")
    with pytest.raises(ConversionError, match=r"absent\.gguf: GGUF file not found"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_wrong_architecture_and_missing_metadata(shared_models_dir: Path, tmp_path: Path) -> None:
    source = shared_models_dir / "stories260K.gguf"
    with pytest.raises(
        ConversionError, match=r"odd\.gguf: architecture 'frobnicator' is not one transformers"
    ):
        convert_gguf(write_gguf(tmp_path / "odd.gguf", source, arch="frobnicator"), tmp_path / "out")
    no_eps = write_gguf(tmp_path / "no_eps.gguf", source, skip_rms_eps=True)
    with pytest.raises(ConversionError, match=r"'llama\.attention\.layer_norm_rms_epsilon' is missing"):
        convert_gguf(no_eps, tmp_path / "out")
