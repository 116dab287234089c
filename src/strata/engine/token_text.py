"""The strings of logprob tokens: each token as the text it adds to its choice, so the tokens join up.

A token's own vocabulary piece is not its text: SentencePiece writes a leading space as '▁' ('▁there' is
' there'), byte-level BPE maps every byte to a printable character ('Ġthere'), and byte-fallback or
byte-level tokens can hold part of one UTF-8 character. `TokenTexts` turns each token into its raw bytes
(the tokenizer's own decoding rules, per piece) and decodes the bytes of a token sequence incrementally:
a token gets the characters it completes. A token that only starts a character is shown as OpenAI shows
it, `bytes:\\xe2\\x80`, and the token that completes the character carries all of it; the `bytes` of the
tokens always concatenate to the UTF-8 of the text. Tokens that the text leaves out (`<s>` when special
tokens are skipped, a lone '▁' that decoding drops at the start) are not listed at all.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def _byte_level_decoding() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    codes = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes, strict=True)}


def escape_bytes(raw: bytes) -> str:
    """OpenAI's string for a token that is only part of a character: `bytes:\\xe2\\x80`."""
    return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)


@dataclass(frozen=True)
class TokenPiece:
    """One listed token: its id, the characters it completes, and its own bytes."""

    token_id: int
    text: str
    raw: bytes

    @property
    def display(self) -> str:
        """The token's string in a response: its text, or its escaped bytes while a character is open."""
        return self.text if self.text or not self.raw else escape_bytes(self.raw)


class TokenTexts:
    """Raw bytes and in-context text of a tokenizer's tokens (cached per token id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.special_ids = frozenset(tokenizer.all_special_ids)
        self.added = {
            token_id: token.content
            for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        }
        decoders = self._decoder_types(tokenizer)
        self.byte_level = "ByteLevel" in decoders
        self.metaspace = "Metaspace" in decoders or "Replace" in decoders
        self._bytes: dict[int, bytes] = {}
        self.strips_first_space = self._strips_first_space()

    @staticmethod
    def _decoder_types(tokenizer: Any) -> set[str]:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return set()
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        return {part.get("type", "") for part in parts}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to the text, before any strip at the start of a sequence."""
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._compute_bytes(token_id)
            self._bytes[token_id] = raw
        return raw

    def _compute_bytes(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if self.byte_level:
            table = _byte_level_decoding()
            if all(char in table for char in piece):
                return bytes(table[char] for char in piece)
        if self.metaspace:
            fallback = _BYTE_FALLBACK.fullmatch(piece)
            if fallback is not None:
                return bytes([int(fallback.group(1), 16)])
            return piece.replace("▁", " ").encode()
        # A tokenizer of another kind (WordPiece, ...): its own rendering of the lone token.
        return self.tokenizer.convert_tokens_to_string([piece]).encode()

    def _strips_first_space(self) -> bool:
        """Whether the tokenizer's decode drops the leading space of a sequence's first token
        (SentencePiece's dummy prefix), found by decoding one vocabulary token that starts with a space."""
        for token_id in range(min(len(self.tokenizer), 4096)):
            raw = self.token_bytes(token_id)
            if token_id not in self.added and len(raw) > 1 and raw.startswith(b" "):
                return not self.tokenizer.decode([token_id]).startswith(" ")
        return False

    def standalone(self, token_id: int) -> str:
        """A candidate token's string on its own (top logprobs): its text, or its escaped bytes."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return escape_bytes(raw)

    def decoder(self, skip_special_tokens: bool, at_start: bool) -> PieceDecoder:
        return PieceDecoder(self, skip_special_tokens, at_start)


class PieceDecoder:
    """Turns a growing token sequence into `TokenPiece`s, carrying an open character across calls (so a
    stream can feed it chunk by chunk)."""

    def __init__(self, texts: TokenTexts, skip_special_tokens: bool, at_start: bool) -> None:
        self.texts = texts
        self.skip_special_tokens = skip_special_tokens
        # At the start of a sequence the tokenizer's decoder drops the first token's leading space.
        self.at_start = at_start
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_ids: list[int], final: bool = False) -> list[TokenPiece | None]:
        """One entry per token: its piece, or None for a token the text leaves out (a skipped special
        token, SentencePiece's lone leading '▁'). With `final`, an open character at the end is closed
        (as U+FFFD, as the tokenizer's own decode does)."""
        pieces: list[TokenPiece | None] = []
        for position, token_id in enumerate(token_ids):
            if self.skip_special_tokens and token_id in self.texts.special_ids:
                pieces.append(None)
                continue
            raw = self.texts.token_bytes(token_id)
            data = raw
            if self.at_start and self.texts.strips_first_space:
                data = raw.removeprefix(b" ")
                if not data and raw:  # a lone '▁' first: decoding drops it, so the text has none of it
                    pieces.append(None)
                    continue
            self.at_start = False
            last = final and position == len(token_ids) - 1
            pieces.append(TokenPiece(token_id, self._utf8.decode(data, final=last), raw))
        return pieces
