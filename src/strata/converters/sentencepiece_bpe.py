"""SentencePiece-style BPE vocabularies (llama, llama2.c) as a `tokenizers.Tokenizer` and HF tokenizer files.

Both source formats (llama2.c's tokenizer.bin and GGUF metadata) carry only pieces, scores and piece types,
never merges. SentencePiece's BPE (and llama2.c's `encode()`) repeatedly merges the adjacent pair whose
concatenation is the highest-scoring piece, leftmost first on ties. `tokenizers`' BPE merges by rank, leftmost
first on ties, so listing every split of every piece, ordered by the merged piece's score, reproduces it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, normalizers, processors
from tokenizers.models import BPE

from strata.converters.errors import ConversionError

SPACE = "\u2581"
# `tokenizers`' byte fallback looks byte pieces up by exactly this spelling.
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")
# transformers 5 maps this name to `TokenizersBackend`, which loads tokenizer.json unchanged (and transformers 4
# reads it the same way). "LlamaTokenizer" would instead rebuild the backend from vocab and merges with its own
# Metaspace pre-tokenizer, silently replacing the normalizer written here.
TOKENIZER_CLASS = "PreTrainedTokenizerFast"


class PieceType(IntEnum):
    """SentencePiece's piece types, numbered as GGUF's `tokenizer.ggml.token_type` stores them."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True)
class SentencePieceVocab:
    """A SentencePiece BPE vocabulary; ids are list positions and pieces spell spaces as '▁'."""

    pieces: list[str]
    scores: list[float]
    types: list[PieceType]
    bos_id: int
    eos_id: int
    unk_id: int
    source: str
    pad_id: int | None = None
    add_bos: bool = True
    add_eos: bool = False

    def __post_init__(self) -> None:
        n = len(self.pieces)
        if n == 0:
            raise ConversionError(f"{self.source}: the tokenizer has no pieces")
        if len(self.scores) != n or len(self.types) != n:
            raise ConversionError(
                f"{self.source}: tokenizer has {n} pieces but {len(self.scores)} scores and {len(self.types)} types"
            )
        for name in ("bos_id", "eos_id", "unk_id", "pad_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < n:
                raise ConversionError(f"{self.source}: {name} {value} is outside the vocabulary (0..{n - 1})")
        seen: dict[str, int] = {}
        for i, piece in enumerate(self.pieces):
            if piece in seen:
                raise ConversionError(
                    f"{self.source}: piece {piece!r} appears twice (ids {seen[piece]} and {i})"
                )
            seen[piece] = i
            if self.types[i] == PieceType.BYTE and not BYTE_PIECE.fullmatch(piece):
                raise ConversionError(
                    f"{self.source}: byte piece {i} is {piece!r}, expected the form '<0xAB>'"
                )

    def ids_of(self, *kinds: PieceType) -> list[int]:
        """Ids of the pieces of the given types, in id order."""
        return [i for i, t in enumerate(self.types) if t in kinds]


def derive_merges(vocab: SentencePieceVocab) -> list[tuple[str, str]]:
    """Every (left, right) split of every normal piece into two normal pieces, best merged piece first.

    Ties in score go to the lower id, which is SentencePiece's own order for its pieces.
    """
    mergeable = {vocab.pieces[i] for i in vocab.ids_of(PieceType.NORMAL)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for i in vocab.ids_of(PieceType.NORMAL):
        piece = vocab.pieces[i]
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-vocab.scores[i], i, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _post_processor(vocab: SentencePieceVocab) -> processors.TemplateProcessing:
    """BOS/EOS template in exactly the form transformers' `update_post_processor` builds, so loading keeps it."""
    bos, eos = vocab.pieces[vocab.bos_id], vocab.pieces[vocab.eos_id]
    single = f"{(bos + ':0 ') if vocab.add_bos else ''}$A:0{(' ' + eos + ':0') if vocab.add_eos else ''}"
    pair = f"{single}{(' ' + bos + ':1') if vocab.add_bos else ''} $B:1{(' ' + eos + ':1') if vocab.add_eos else ''}"
    special = [(bos, vocab.bos_id)] if vocab.add_bos else []
    if vocab.add_eos:
        special.append((eos, vocab.eos_id))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_tokenizer(vocab: SentencePieceVocab) -> Tokenizer:
    """The llama "legacy" SentencePiece scheme: a dummy-prefix '▁' on non-empty text, spaces as '▁', byte fallback."""
    model = BPE(
        vocab={piece: i for i, piece in enumerate(vocab.pieces)},
        merges=derive_merges(vocab),
        unk_token=vocab.pieces[vocab.unk_id],
        fuse_unk=True,
        byte_fallback=bool(vocab.ids_of(PieceType.BYTE)),
    )
    tokenizer = Tokenizer(model)
    # Prepend leaves empty text empty, like llama2.c's `if (text[0] != '\0')` before adding the dummy prefix.
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.post_processor = _post_processor(vocab)
    tokenizer.add_special_tokens(
        [
            AddedToken(vocab.pieces[i], special=True, normalized=False)
            for i in vocab.ids_of(PieceType.UNKNOWN, PieceType.CONTROL)
        ]
    )
    user_defined = vocab.ids_of(PieceType.USER_DEFINED)
    if user_defined:
        tokenizer.add_tokens(
            [AddedToken(vocab.pieces[i], special=False, normalized=False) for i in user_defined]
        )
    return tokenizer


def write_tokenizer_files(vocab: SentencePieceVocab, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json and a tokenizer_config.json that plain `AutoTokenizer` loads unchanged."""
    build_tokenizer(vocab).save(str(out_dir / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": TOKENIZER_CLASS,
        "bos_token": vocab.pieces[vocab.bos_id],
        "eos_token": vocab.pieces[vocab.eos_id],
        "unk_token": vocab.pieces[vocab.unk_id],
        "add_bos_token": vocab.add_bos,
        "add_eos_token": vocab.add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if vocab.pad_id is not None:
        config["pad_token"] = vocab.pieces[vocab.pad_id]
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
