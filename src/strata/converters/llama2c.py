"""llama2.c checkpoints (legacy v0 float32 layout) and tokenizer.bin files to a Hugging Face Llama folder.

The v0 layout has no magic and no version: a header of seven int32 and then raw float32 arrays in a fixed
order. The only integrity check available is that the file size is exactly what the header implies, so it is
checked before anything is read.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path

import numpy as np

from strata.converters.errors import ConversionError
from strata.converters.hf_folder import LlamaSpec, TensorSource, rope_interleaved_to_half, write_hf_folder
from strata.converters.sentencepiece_bpe import BYTE_PIECE, SPACE, PieceType, SentencePieceVocab

_HEADER = struct.Struct("<7i")
_HEADER_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")
# llama2.c's export.py versions 1 and 2 start with this magic ("ak42"); only v0 (no magic) is supported.
_VERSIONED_MAGIC = 0x616B3432
# run.c hardcodes both; the checkpoint does not store them.
_RMS_NORM_EPS = 1e-5
_ROPE_THETA = 10000.0
# llama2.c's exporter wrote these pieces with its own spelling of BOS and EOS.
_SPECIAL_PIECES = {
    "<unk>": ("<unk>", PieceType.UNKNOWN),
    "\n<s>\n": ("<s>", PieceType.CONTROL),
    "\n</s>\n": ("</s>", PieceType.CONTROL),
}


def _load(floats: np.memmap, start: int, shape: tuple[int, ...], rope_heads: int | None) -> np.ndarray:
    array = np.array(floats[start : start + int(np.prod(shape))]).reshape(shape)
    return array if rope_heads is None else rope_interleaved_to_half(array, rope_heads)


def _read_checkpoint(path: Path) -> tuple[LlamaSpec, dict[str, TensorSource]]:
    size = path.stat().st_size
    if size < _HEADER.size:
        raise ConversionError(
            f"{path.name}: {size} bytes is too short for a llama2.c checkpoint (expected a {_HEADER.size}-byte "
            "header of 7 int32 and then the weights)"
        )
    with path.open("rb") as f:
        raw = f.read(_HEADER.size)
    if struct.unpack_from("<I", raw)[0] == _VERSIONED_MAGIC:
        raise ConversionError(
            f"{path.name}: this is a versioned llama2.c export (magic 'ak42'); only the legacy v0 float32 layout "
            "(export.py --version 0) is supported"
        )
    if raw.startswith(b"GGUF"):
        raise ConversionError(
            f"{path.name} is a GGUF file, not a llama2.c checkpoint; use `strata convert gguf`"
        )
    header = dict(zip(_HEADER_FIELDS, _HEADER.unpack(raw), strict=True))
    if min(abs(v) if k == "vocab_size" else v for k, v in header.items()) <= 0:
        raise ConversionError(
            f"{path.name}: not a llama2.c v0 checkpoint, its header {header} has sizes that are not positive"
        )
    dim, hidden, n_layers = header["dim"], header["hidden_dim"], header["n_layers"]
    n_heads, n_kv_heads, seq_len = header["n_heads"], header["n_kv_heads"], header["max_seq_len"]
    # A negative vocab_size is llama2.c's flag for a separate classifier stored after everything else.
    shared, vocab_size = header["vocab_size"] > 0, abs(header["vocab_size"])
    spec = LlamaSpec(
        hidden_size=dim,
        intermediate_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv_heads,
        vocab_size=vocab_size,
        max_position_embeddings=seq_len,
        rms_norm_eps=_RMS_NORM_EPS,
        rope_theta=_ROPE_THETA,
        tie_word_embeddings=shared,
        source=path.name,
    )
    head_dim, kv_dim = spec.head_dim, n_kv_heads * spec.head_dim
    layout: list[tuple[str, tuple[int, ...]]] = [
        ("token_embedding", (vocab_size, dim)),
        ("rms_att", (n_layers, dim)),
        ("wq", (n_layers, dim, dim)),
        ("wk", (n_layers, kv_dim, dim)),
        ("wv", (n_layers, kv_dim, dim)),
        ("wo", (n_layers, dim, dim)),
        ("rms_ffn", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_cis_real", (seq_len, head_dim // 2)),
        ("freq_cis_imag", (seq_len, head_dim // 2)),
    ]
    if not shared:
        layout.append(("wcls", (vocab_size, dim)))
    expected = _HEADER.size + 4 * sum(int(np.prod(shape)) for _, shape in layout)
    if size != expected:
        problem = "is truncated" if size < expected else "has a header that does not match the file size"
        raise ConversionError(
            f"{path.name} {problem}: the header {header} implies {expected} bytes of a legacy v0 checkpoint, "
            f"the file has {size}"
        )

    floats = np.memmap(path, dtype="<f4", mode="r", offset=_HEADER.size)
    offsets: dict[str, tuple[int, tuple[int, ...]]] = {}
    offset = 0
    for name, shape in layout:
        offsets[name] = (offset, shape)
        offset += int(np.prod(shape))

    def source(name: str, layer: int | None = None, rope_heads: int | None = None) -> TensorSource:
        start, shape = offsets[name]
        if layer is not None:
            shape = shape[1:]
            start += layer * int(np.prod(shape))
        return TensorSource(shape, functools.partial(_load, floats, start, shape, rope_heads))

    tensors = {"model.embed_tokens.weight": source("token_embedding")}
    for i in range(n_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": source("rms_att", i),
            p + "self_attn.q_proj.weight": source("wq", i, rope_heads=n_heads),
            p + "self_attn.k_proj.weight": source("wk", i, rope_heads=n_kv_heads),
            p + "self_attn.v_proj.weight": source("wv", i),
            p + "self_attn.o_proj.weight": source("wo", i),
            p + "post_attention_layernorm.weight": source("rms_ffn", i),
            p + "mlp.gate_proj.weight": source("w1", i),
            p + "mlp.down_proj.weight": source("w2", i),
            p + "mlp.up_proj.weight": source("w3", i),
        }
    tensors["model.norm.weight"] = source("rms_final")
    if not shared:
        tensors["lm_head.weight"] = source("wcls")
    return spec, tensors


def read_llama2c_tokenizer(path: str | Path) -> SentencePieceVocab:
    """Parse llama2.c's tokenizer.bin: int32 max_token_length, then per piece float32 score, int32 length, bytes."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ConversionError(f"{path}: cannot read the tokenizer ({e.strerror})") from e
    if len(data) < 4:
        raise ConversionError(f"{path.name}: {len(data)} bytes is too short for a llama2.c tokenizer")
    pieces: list[str] = []
    scores: list[float] = []
    types: list[PieceType] = []
    offset = 4
    while offset < len(data):
        i = len(pieces)
        if offset + 8 > len(data):
            raise ConversionError(
                f"{path.name} is truncated: piece {i} at byte {offset} has no score and length"
            )
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if length < 0 or offset + length > len(data):
            raise ConversionError(
                f"{path.name} is truncated or corrupt: piece {i} claims {length} bytes at byte {offset}, "
                f"the file has {len(data)}"
            )
        try:
            text = data[offset : offset + length].decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConversionError(f"{path.name}: piece {i} is not valid UTF-8 ({e.reason})") from e
        offset += length
        if text in _SPECIAL_PIECES:
            text, kind = _SPECIAL_PIECES[text]
        elif BYTE_PIECE.fullmatch(text):
            kind = PieceType.BYTE
        else:
            # llama2.c's exporter turned SentencePiece's '▁' into a plain space; turn it back.
            text, kind = text.replace(" ", SPACE), PieceType.NORMAL
        pieces.append(text)
        scores.append(score)
        types.append(kind)
    ids = {piece: i for i, piece in enumerate(pieces)}
    missing = [piece for piece in ("<unk>", "<s>", "</s>") if piece not in ids]
    if missing:
        raise ConversionError(f"{path.name}: expected the pieces <unk>, <s> and </s>; {missing} not found")
    return SentencePieceVocab(
        pieces, scores, types, bos_id=ids["<s>"], eos_id=ids["</s>"], unk_id=ids["<unk>"], source=path.name
    )


def convert_llama2c(
    checkpoint: str | Path, tokenizer: str | Path, out_dir: str | Path, overwrite: bool = False
) -> Path:
    """Convert a llama2.c v0 checkpoint and its tokenizer.bin into a Hugging Face Llama folder; returns it."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise ConversionError(f"{checkpoint}: checkpoint file not found")
    spec, tensors = _read_checkpoint(checkpoint)
    vocab = read_llama2c_tokenizer(tokenizer)
    return write_hf_folder(Path(out_dir), spec, tensors, vocab, overwrite=overwrite)
