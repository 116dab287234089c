"""GGUF files to Hugging Face folders, every weight float32, so plain `transformers` loads them.

Llama-architecture files with a SentencePiece vocabulary and F32, F16, BF16 or Q8_0 tensors (llama2.c
exports, the shared stories260K) are written by this module's own Llama writer, whose tokenizer matches
the original SentencePiece model piece for piece. Every other file transformers reads from GGUF (any
architecture, BPE vocabularies, K-quants) goes through Strata's GGUF loader into transformers' own model
class, dequantized, and is saved by transformers. Files are opened by `strata.gguf.file`, whose errors
name the file and the problem.

With
`keep_quantized`, Q8_0 Linear weights stay int8 on disk (`<x>.qweight` int8 plus `<x>.qscale`, the
float16 scale of each block of 32), a quarter of the bytes, and config.json gets a `quantization_config`
that makes Strata load the folder with `quantization="int8"` (transformers cannot load it).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField
from gguf.quants import dequantize

from strata.config import INT8_QUANT_METHOD
from strata.converters.errors import ConversionError
from strata.converters.hf_folder import (
    LlamaSpec,
    TensorSource,
    prepare_out_dir,
    rope_interleaved_to_half,
    write_hf_folder,
)
from strata.converters.sentencepiece_bpe import PieceType, SentencePieceVocab
from strata.gguf.file import GGUFError, load_tokenizer, open_gguf

SUPPORTED_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
)
# GGUF (llama.cpp) tensor name suffix -> HF Llama name suffix, per layer and global.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Q8_0 block: a float16 scale, then 32 int8 values.
_Q8_0_BLOCK = 32
_Q8_0_BYTES = 2 + _Q8_0_BLOCK
# The one matrix that is not a Linear weight, so --keep-quantized writes it as float32.
_EMBEDDING = "model.embed_tokens.weight"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _open(path: Path) -> GGUFReader:
    try:
        return open_gguf(path)
    except GGUFError as e:
        raise ConversionError(str(e)) from e


def _sentencepiece_llama(reader: GGUFReader) -> bool:
    """Whether this module's own Llama writer takes every tensor: known names, supported types."""
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        named = tensor.name in _GLOBAL_NAMES or (len(parts) == 4 and parts[2] in _LAYER_NAMES)
        if not named or tensor.tensor_type not in SUPPORTED_TYPES:
            return False
    return True


def _convert_with_transformers(path: Path, out_dir: Path, overwrite: bool) -> Path:
    """Any architecture transformers reads from GGUF: its model with every weight dequantized to float32,
    and its tokenizer, saved by transformers."""
    from strata.models.transformers.loader import WeightLoadError, load_gguf_as_transformers

    try:
        model = load_gguf_as_transformers(path)
        tokenizer = load_tokenizer(path)
    except (GGUFError, WeightLoadError) as e:
        raise ConversionError(str(e)) from e
    prepare_out_dir(out_dir, overwrite)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def _value(path: Path, field: ReaderField) -> Any:
    """A metadata value as Python data (str, int, float, bool or list of them)."""
    kind = field.types[0]
    try:
        if kind == GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        if kind == GGUFValueType.ARRAY:
            if field.types[1] == GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [field.parts[i][0].item() for i in field.data]
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path.name}: metadata {field.name!r} holds a string that is not UTF-8") from e
    return field.parts[field.data[0]][0].item()


class _Metadata:
    """Typed access to GGUF metadata with errors that name the file and the key."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self.fields = reader.fields

    def get(self, key: str, default: Any = None, required: bool = False) -> Any:
        field = self.fields.get(key)
        if field is None:
            if required:
                raise ConversionError(f"{self.path.name}: metadata key {key!r} is missing")
            return default
        return _value(self.path, field)

    def number(self, key: str, default: float | None = None) -> float:
        value = self.get(key, default, required=default is None)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConversionError(f"{self.path.name}: metadata {key!r} should be a number, found {value!r}")
        return value

    def size(self, key: str, default: int | None = None) -> int:
        value = self.number(key, default)
        if not isinstance(value, int):
            raise ConversionError(f"{self.path.name}: metadata {key!r} should be an integer, found {value!r}")
        return value


def _shortest_float(value: float) -> float:
    """GGUF stores float32; 9.999999747e-06 is meant as 1e-05, so keep the shortest float32 spelling."""
    return float(str(np.float32(value)))


def _read_vocab(path: Path, meta: _Metadata) -> SentencePieceVocab:
    model = meta.get("tokenizer.ggml.model", required=True)
    if model != "llama":
        raise ConversionError(
            f"{path.name}: tokenizer.ggml.model is {model!r}; only 'llama' (SentencePiece BPE) is supported"
        )
    pieces = meta.get("tokenizer.ggml.tokens", required=True)
    if not isinstance(pieces, list) or not all(isinstance(p, str) for p in pieces):
        raise ConversionError(f"{path.name}: tokenizer.ggml.tokens should be an array of strings")
    n = len(pieces)
    scores = meta.get("tokenizer.ggml.scores", required=True)
    raw_types = meta.get("tokenizer.ggml.token_type", [PieceType.NORMAL] * n)
    try:
        types = [PieceType(t) for t in raw_types]
    except ValueError as e:
        raise ConversionError(
            f"{path.name}: tokenizer.ggml.token_type holds an unknown piece type ({e})"
        ) from e

    def token_id(key: str, default: int | None) -> int | None:
        # Absent ids, and ids outside the vocabulary (the shared file's pad id is 4294967295, i.e. -1), mean none.
        value = meta.get(f"tokenizer.ggml.{key}_token_id", default)
        return value if isinstance(value, int) and 0 <= value < n else None

    bos, eos, unk = token_id("bos", None), token_id("eos", None), token_id("unknown", None)
    if bos is None or eos is None or unk is None:
        raise ConversionError(
            f"{path.name}: expected BOS, EOS and unknown token ids inside the vocabulary of {n}; "
            f"found bos={meta.get('tokenizer.ggml.bos_token_id')}, eos={meta.get('tokenizer.ggml.eos_token_id')}, "
            f"unknown={meta.get('tokenizer.ggml.unknown_token_id')}"
        )
    return SentencePieceVocab(
        pieces,
        [float(s) for s in scores],
        types,
        bos_id=bos,
        eos_id=eos,
        unk_id=unk,
        pad_id=token_id("padding", None),
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        source=path.name,
    )


def _hf_name(path: Path, name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    raise ConversionError(f"{path.name}: tensor {name!r} has no counterpart in a Hugging Face Llama model")


def _load(
    data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...], rope_heads: int | None
) -> np.ndarray:
    array = dequantize(data, qtype).reshape(shape)
    return array if rope_heads is None else rope_interleaved_to_half(array, rope_heads)


def _q8_0_parts(data: np.ndarray, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The int8 values (`shape`) and float16 block scales (`[rows, cols / 32]`) of raw Q8_0 data."""
    blocks = np.ascontiguousarray(data).reshape(-1, _Q8_0_BYTES)
    rows, cols = shape
    scales = blocks[:, :2].copy().view(np.float16).reshape(rows, cols // _Q8_0_BLOCK)
    return blocks[:, 2:].copy().view(np.int8).reshape(rows, cols), scales


def _load_q8_0_part(
    data: np.ndarray, shape: tuple[int, ...], rope_heads: int | None, part: int
) -> np.ndarray:
    """Part 0 (int8 values) or 1 (block scales) of a Q8_0 tensor, rows reordered like `_load`'s."""
    array = _q8_0_parts(data, shape)[part]
    return array if rope_heads is None else rope_interleaved_to_half(array, rope_heads)


def convert_gguf(
    path: str | Path, out_dir: str | Path, overwrite: bool = False, keep_quantized: bool = False
) -> Path:
    """Convert a llama-architecture GGUF file into a Hugging Face Llama folder; returns it.

    `keep_quantized` keeps Q8_0 Linear weights as int8 with their block scales (see the module docstring).
    """
    path = Path(path)
    reader = _open(path)
    meta = _Metadata(path, reader)
    arch = meta.get("general.architecture", required=True)
    if keep_quantized and arch != "llama":
        raise ConversionError(f"{path.name}: --keep-quantized converts llama-architecture files only")
    if arch != "llama" or meta.get("tokenizer.ggml.model") != "llama" or not _sentencepiece_llama(reader):
        return _convert_with_transformers(path, Path(out_dir), overwrite)
    scaling = meta.get("llama.rope.scaling.type", "none")
    if scaling != "none":
        raise ConversionError(f"{path.name}: RoPE scaling {scaling!r} is not supported")

    vocab = _read_vocab(path, meta)
    by_name = {t.name: t for t in reader.tensors}
    # llama.cpp's converters write output.weight even for a shared classifier; identical bytes mean tied.
    output, embedding = by_name.get("output.weight"), by_name.get("token_embd.weight")
    tied = output is None or (
        embedding is not None
        and output.tensor_type == embedding.tensor_type
        and np.array_equal(output.data, embedding.data)
    )
    n_heads = meta.size("llama.attention.head_count")
    spec = LlamaSpec(
        hidden_size=meta.size("llama.embedding_length"),
        intermediate_size=meta.size("llama.feed_forward_length"),
        num_layers=meta.size("llama.block_count"),
        num_heads=n_heads,
        num_kv_heads=meta.size("llama.attention.head_count_kv", n_heads),
        vocab_size=len(vocab.pieces),
        max_position_embeddings=meta.size("llama.context_length"),
        rms_norm_eps=_shortest_float(meta.number("llama.attention.layer_norm_rms_epsilon")),
        rope_theta=_shortest_float(meta.number("llama.rope.freq_base", 10000.0)),
        tie_word_embeddings=tied,
        source=path.name,
    )
    for key in ("llama.rope.dimension_count", "llama.attention.key_length", "llama.attention.value_length"):
        if meta.size(key, spec.head_dim) != spec.head_dim:
            raise ConversionError(
                f"{path.name}: {key} is {meta.get(key)}; only the head size {spec.head_dim} is supported"
            )

    rope_heads = {"self_attn.q_proj.weight": spec.num_heads, "self_attn.k_proj.weight": spec.num_kv_heads}
    tensors: dict[str, TensorSource] = {}
    for tensor in reader.tensors:
        if tied and tensor.name == "output.weight":
            continue
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise ConversionError(
                f"{path.name}: tensor {tensor.name!r} has type {tensor.tensor_type.name}; supported types are "
                f"{', '.join(t.name for t in SUPPORTED_TYPES)}"
            )
        name = _hf_name(path, tensor.name)
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        heads = rope_heads.get(name.split(".", 3)[-1]) if name.startswith("model.layers.") else None
        if keep_quantized and tensor.tensor_type == GGMLQuantizationType.Q8_0 and name != _EMBEDDING:
            if len(shape) != 2 or shape[1] % _Q8_0_BLOCK:
                raise ConversionError(
                    f"{path.name}: Q8_0 tensor {tensor.name!r} of shape {list(shape)} does not split its rows "
                    f"into blocks of {_Q8_0_BLOCK}"
                )
            base = name.removesuffix(".weight")
            part = functools.partial(_load_q8_0_part, tensor.data, shape, heads)
            tensors[f"{base}.qweight"] = TensorSource(shape, functools.partial(part, 0), "I8")
            scales_shape = (shape[0], shape[1] // _Q8_0_BLOCK)
            tensors[f"{base}.qscale"] = TensorSource(scales_shape, functools.partial(part, 1), "F16")
            continue
        tensors[name] = TensorSource(
            shape, functools.partial(_load, tensor.data, tensor.tensor_type, shape, heads)
        )
    quantized = any(name.endswith(".qweight") for name in tensors)
    quantization_config = (
        {"quant_method": INT8_QUANT_METHOD, "bits": 8, "group_size": _Q8_0_BLOCK, "source": "gguf Q8_0"}
        if quantized
        else None
    )
    return write_hf_folder(
        Path(out_dir), spec, tensors, vocab, overwrite=overwrite, quantization_config=quantization_config
    )
