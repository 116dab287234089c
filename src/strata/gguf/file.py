"""GGUF files as a model format: find one, open it safely, read its config and tokenizer.

Parsing is the `gguf` package's `GGUFReader` (it maps the file, so tensors are read lazily); the config and
the tokenizer come from transformers' GGUF integration, as `from_pretrained(..., gguf_file=...)` builds them,
so every architecture and tokenizer transformers reads from GGUF works here without a table of Strata's own.
This module only turns their generic failures (numpy reshape errors, struct errors, bare ValueErrors) into a
`GGUFError` that names the file and the problem.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderField

GGUF_SUFFIX = ".gguf"
_MAGIC = b"GGUF"
_MIN_SIZE = 24  # magic, version, tensor count and metadata count


_SPECIAL_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "sep_token_id")


class GGUFError(ValueError):
    """A GGUF file Strata cannot load: truncated, corrupt, or of an architecture or type it cannot run."""


def find_gguf(model: str | Path) -> Path | None:
    """The GGUF file `model` names: the file itself, or the one `.gguf` file of a folder without a
    `config.json`; None for a Hugging Face folder (or anything else)."""
    path = Path(model)
    if path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    files = sorted(p for p in path.iterdir() if p.suffix.lower() == GGUF_SUFFIX and p.is_file())
    if len(files) > 1:
        raise GGUFError(
            f"model folder {str(path)!r} holds {len(files)} GGUF files ({', '.join(p.name for p in files)}); "
            "pass the one to load"
        )
    return files[0] if files else None


class _CheckedReader(GGUFReader):
    """GGUFReader that checks each tensor's type and extent before the base class maps its data.

    Without this, an unknown type id or a truncated data section surfaces as a bare numpy reshape error.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._size = path.stat().st_size
        super().__init__(path)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        for field in fields:
            _, name_data, _, dims, raw_type, rel_offset = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise GGUFError(
                    f"{self._path.name}: tensor {name!r} has unknown GGML type id {int(raw_type[0])}"
                ) from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_elements = int(np.prod(dims))
            if n_elements % block:
                raise GGUFError(
                    f"{self._path.name}: tensor {name!r} of {n_elements} elements does not fill whole "
                    f"{qtype.name} blocks of {block}"
                )
            end = int(start_offs) + int(rel_offset[0]) + n_elements // block * type_size
            if end > self._size:
                raise GGUFError(
                    f"{self._path.name} is truncated: tensor {name!r} ({qtype.name}, shape {dims.tolist()}) "
                    f"ends at byte {end}, the file has {self._size}"
                )
        super()._build_tensors(start_offs, fields)


def open_gguf(path: str | Path) -> GGUFReader:
    """A reader of the GGUF file at `path`, its header, metadata and tensor extents checked; one per
    version of the file (parsing a large vocabulary's metadata takes seconds)."""
    path = Path(path).resolve()
    if not path.is_file():
        raise GGUFError(f"{path}: GGUF file not found")
    stat = path.stat()
    return _open(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=4)
def _open(path: Path, mtime_ns: int, size: int) -> GGUFReader:
    with path.open("rb") as f:
        head = f.read(_MIN_SIZE)
    if not _MAGIC.startswith(head[:4]):
        raise GGUFError(f"{path.name}: not a GGUF file (expected magic {_MAGIC!r}, found {head[:4]!r})")
    if len(head) < _MIN_SIZE:
        raise GGUFError(f"{path.name} is truncated: {len(head)} bytes, a GGUF header needs {_MIN_SIZE}")
    try:
        return _CheckedReader(path)
    except GGUFError:
        raise
    except (ValueError, KeyError, IndexError, OverflowError, UnicodeDecodeError, MemoryError) as e:
        # The metadata section is read field by field; running off the end shows up as one of these.
        raise GGUFError(
            f"{path.name} is truncated or corrupt: its metadata cannot be read "
            f"({path.stat().st_size} bytes; gguf reader: {e})"
        ) from e


def architecture(reader: GGUFReader) -> str:
    """The file's `general.architecture` (llama.cpp's name: llama, qwen2, gemma3, ...)."""
    field = reader.fields.get("general.architecture")
    if field is None:
        raise GGUFError(f"{Path(reader.data.filename).name}: metadata key 'general.architecture' is missing")
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def _supported_architectures() -> list[str]:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    return sorted(set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"})


def load_config(path: Path) -> Any:
    """The transformers config that `path`'s metadata describes."""
    from transformers import AutoConfig

    open_gguf(path)  # a bad file fails here, with the problem named, not inside transformers
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, TypeError, IndexError, OSError, NotImplementedError) as exc:
        arch = architecture(open_gguf(path))
        if arch not in _supported_architectures():
            raise GGUFError(
                f"{path.name}: architecture {arch!r} is not one transformers reads from GGUF "
                f"(it reads {', '.join(_supported_architectures())})"
            ) from exc
        raise GGUFError(f"{path.name}: transformers cannot build a config from its metadata ({exc})") from exc
    vocab_size = getattr(config.get_text_config(), "vocab_size", None)
    for name in _SPECIAL_TOKEN_IDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and vocab_size is not None and not 0 <= value < vocab_size:
            setattr(config, name, None)  # llama.cpp's "none" (2**32 - 1), not a token
    return config


def load_tokenizer(path: Path) -> Any:
    """The tokenizer (with its chat template) that `path`'s metadata describes: SentencePiece and BPE
    vocabularies alike, built by transformers' GGUF tokenizer conversion."""
    from transformers import AutoTokenizer

    open_gguf(path)  # a bad file fails here, with the problem named, not inside transformers
    try:
        try:
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        except IndexError:
            return _tokenizer_ignoring_absent_special_tokens(path)
    except (ValueError, KeyError, TypeError, IndexError, OSError, NotImplementedError, AttributeError) as exc:
        raise GGUFError(
            f"{path.name}: transformers cannot build a tokenizer from its metadata ({exc}); pass a tokenizer "
            "folder (tokenizer=..., --tokenizer)"
        ) from exc


def _tokenizer_ignoring_absent_special_tokens(path: Path) -> Any:
    """transformers' GGUF tokenizer, assembled from its own parts, for files that give a special token id
    outside the vocabulary: llama.cpp's exporters write 2**32 - 1 for "none", where transformers' loader
    indexes the vocabulary with it."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
        read_gguf_metadata,
    )

    metadata, _ = read_gguf_metadata(str(path), ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    groups = {
        group: {
            name: metadata[f"tokenizer.{key}"] for key, name in keys.items() if f"tokenizer.{key}" in metadata
        }
        for group, keys in GGUF_TOKENIZER_MAPPING.items()
    }
    vocabulary, config = groups["tokenizer"], groups["tokenizer_config"]
    tokens = vocabulary["tokens"]
    for name in ("bos", "eos", "unk", "pad"):
        index = vocabulary.pop(f"{name}_token_id", None)
        if isinstance(index, int) and 0 <= index < len(tokens):
            vocabulary[f"{name}_token_id"] = index
            config[f"{name}_token"] = tokens[index]
    if vocabulary.get("tokenizer_type") == "llama":
        config.setdefault("add_bos_token", True)  # llama.cpp's default for SentencePiece vocabularies
    backend, extra = convert_gguf_tokenizer(metadata["general.architecture"], vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **config, **extra)
