"""Write a standard Hugging Face Llama folder (config, safetensors, generation config, tokenizer) from any source.

The converters describe the model as a `LlamaSpec` plus one `TensorSource` per HF tensor; this module checks
names and shapes before anything touches the disk and then streams the tensors into model.safetensors one at a
time, so a large quantised model never needs all of its float32 weights in memory at once.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from strata.atomic_file import write_atomically
from strata.converters.errors import ConversionError
from strata.converters.sentencepiece_bpe import SentencePieceVocab, write_tokenizer_files

# Below this many bytes of float32 weights a conversion takes well under a second: no progress bar.
_PROGRESS_MIN_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class LlamaSpec:
    """The hyperparameters config.json needs, validated so a damaged header fails here with a clear message."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    source: str

    def __post_init__(self) -> None:
        sizes = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
        }
        bad = {k: v for k, v in sizes.items() if v <= 0}
        if bad:
            raise ConversionError(f"{self.source}: expected positive model sizes, found {bad}")
        if self.hidden_size % self.num_heads or self.head_dim % 2:
            raise ConversionError(
                f"{self.source}: hidden size {self.hidden_size} does not split into {self.num_heads} heads "
                "of an even size"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConversionError(
                f"{self.source}: {self.num_heads} attention heads are not a multiple of {self.num_kv_heads} KV heads"
            )
        if not (self.rms_norm_eps > 0 and self.rope_theta > 0):
            raise ConversionError(
                f"{self.source}: expected positive rms_norm_eps and rope_theta, found "
                f"{self.rms_norm_eps} and {self.rope_theta}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every HF tensor this model has, in the order they are written, with its shape."""
        dim, kv_dim, hidden = self.hidden_size, self.num_kv_heads * self.head_dim, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, dim)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes |= {
                p + "input_layernorm.weight": (dim,),
                p + "self_attn.q_proj.weight": (dim, dim),
                p + "self_attn.k_proj.weight": (kv_dim, dim),
                p + "self_attn.v_proj.weight": (kv_dim, dim),
                p + "self_attn.o_proj.weight": (dim, dim),
                p + "post_attention_layernorm.weight": (dim,),
                p + "mlp.gate_proj.weight": (hidden, dim),
                p + "mlp.up_proj.weight": (hidden, dim),
                p + "mlp.down_proj.weight": (dim, hidden),
            }
        shapes["model.norm.weight"] = (dim,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, dim)
        return shapes

    def config_json(self, vocab: SentencePieceVocab) -> dict[str, object]:
        """config.json in transformers 5's own spelling (`rope_parameters`, `dtype`), so it round-trips."""
        config: dict[str, object] = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": vocab.bos_id,
            "eos_token_id": vocab.eos_id,
            "dtype": "float32",
            "use_cache": True,
        }
        if vocab.pad_id is not None:
            config["pad_token_id"] = vocab.pad_id
        return config


# safetensors dtype name -> the little-endian numpy dtype its data is written as.
_SAFETENSORS_DTYPES = {"F32": "<f4", "F16": "<f2", "I8": "i1"}


@dataclass(frozen=True)
class TensorSource:
    """One HF tensor: its shape (known without reading data), how to produce it, and its safetensors dtype."""

    shape: tuple[int, ...]
    load: Callable[[], np.ndarray]
    dtype: str = "F32"


def rope_interleaved_to_half(weight: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder Q/K rows from the adjacent-pair rotary layout (llama2.c, GGUF) to HF Llama's rotate_half layout.

    Per head, rows (x0, y0, x1, y1, ...) rotated as pairs become (x0, x1, ..., y0, y1, ...), so HF's
    rotate_half pairs row i with row i + head_dim/2 exactly as the source paired 2i with 2i+1.
    """
    rows, cols = weight.shape
    return weight.reshape(n_heads, rows // n_heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise ConversionError(f"{out_dir}: output path exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise ConversionError(
            f"{out_dir}: output folder is not empty (pass overwrite / --force to replace files)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)


def _write_safetensors(path: Path, tensors: dict[str, TensorSource], source: str) -> None:
    """Stream tensors into a safetensors file: JSON header with offsets, then raw little-endian data."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = np.dtype(_SAFETENSORS_DTYPES[tensor.dtype]).itemsize * math.prod(tensor.shape)
        header[name] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keeps the data 8-byte aligned, as the format recommends

    def write(partial: Path) -> None:
        with partial.open("wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            bar = tqdm(
                tensors.items(),
                desc=f"converting {source}",
                unit="tensor",
                disable=offset < _PROGRESS_MIN_BYTES,
            )
            for name, tensor in bar:
                array = np.ascontiguousarray(tensor.load(), dtype=_SAFETENSORS_DTYPES[tensor.dtype])
                assert array.shape == tensor.shape, (name, array.shape, tensor.shape)
                f.write(array.data)

    write_atomically(path, write)


def _with_quantized(
    expected: dict[str, tuple[int, ...]], tensors: dict[str, TensorSource], group_size: int
) -> dict[str, tuple[int, ...]]:
    """`expected` with each `<x>.weight` that `tensors` holds as `<x>.qweight` replaced by its int8 weight
    and its per-group scales (see `strata.models.transformers.quantization` for the format)."""
    result: dict[str, tuple[int, ...]] = {}
    for name, shape in expected.items():
        base = name.removesuffix(".weight")
        if name.endswith(".weight") and f"{base}.qweight" in tensors:
            result[f"{base}.qweight"] = shape
            result[f"{base}.qscale"] = (shape[0], shape[1] // group_size)
        else:
            result[name] = shape
    return result


def write_hf_folder(
    out_dir: Path,
    spec: LlamaSpec,
    tensors: dict[str, TensorSource],
    vocab: SentencePieceVocab,
    overwrite: bool = False,
    quantization_config: dict[str, Any] | None = None,
) -> Path:
    """Check the pieces fit together, then write the folder; returns it.

    With `quantization_config` (Strata's int8 format, `group_size` inputs per scale), a Linear weight may come
    as `<x>.qweight` + `<x>.qscale` instead of `<x>.weight`; config.json then carries the config.
    """
    if len(vocab.pieces) != spec.vocab_size:
        raise ConversionError(
            f"{vocab.source}: tokenizer has {len(vocab.pieces)} pieces but the model {spec.source} "
            f"has a vocabulary of {spec.vocab_size}"
        )
    expected = spec.tensor_shapes()
    if quantization_config is not None:
        expected = _with_quantized(expected, tensors, int(quantization_config["group_size"]))
    missing = [name for name in expected if name not in tensors]
    unexpected = [name for name in tensors if name not in expected]
    if missing or unexpected:
        raise ConversionError(f"{spec.source}: tensors missing {missing}, unexpected {unexpected}")
    for name, shape in expected.items():
        if tensors[name].shape != shape:
            raise ConversionError(f"{spec.source}: {name} has shape {tensors[name].shape}, expected {shape}")

    prepare_out_dir(out_dir, overwrite)
    write_tokenizer_files(vocab, out_dir, spec.max_position_embeddings)
    config = spec.config_json(vocab)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"bos_token_id": vocab.bos_id, "eos_token_id": vocab.eos_id}
    if vocab.pad_id is not None:
        generation["pad_token_id"] = vocab.pad_id
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    _write_safetensors(out_dir / "model.safetensors", {name: tensors[name] for name in expected}, spec.source)
    return out_dir
