"""Incremental detokenisation: text grows token by token, never splits a multi-byte character, and each token
is given the text it adds, so the engine's output text and the server's logprob token strings are one thing.

Decoding a token alone loses context (SentencePiece drops a leading space, byte-fallback tokens are fragments
of one character, a decoder may clean up spaces), so each step decodes a short window ending at the new token
and emits only what the window added past its already-emitted part (vLLM's prefix and read offsets). A window
whose text ends in U+FFFD is waiting for the rest of a character and emits nothing yet.

There is one detokenizer, and the server does not get per-token texts from the engine: it builds the same
`IncrementalDetokenizer` from the same inputs the engine built each sequence's from (the prompt's token ids
and `skip_special_tokens` it sends) and feeds it the same tokens. The steps are deterministic, so a choice's
token strings are the engine's text cut at its tokens; disagreement would need a second algorithm, and there
is none. Only logprob requests need the pieces, so the engine's outputs (which a data-parallel engine
pickles every step) do not carry a second copy of the text.

A token's own vocabulary piece is not its text ('▁there' and 'Ġthere' are ' there'), but its raw bytes are
what OpenAI's `bytes` field and the `bytes:\\xe2\\x80` display of a token that only opens a character need;
`TokenTexts` reads them from the vocabulary by the tokenizer's decoding rules.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from typing import Any

# Prompt tokens kept as left context so the first output token decodes with its real spacing.
_CONTEXT_TOKENS = 5

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


class TokenTexts:
    """A tokenizer's tokens as raw bytes (cached per token id) and as candidate strings on their own."""

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

    @staticmethod
    def _decoder_types(tokenizer: Any) -> set[str]:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return set()
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
        return {part.get("type", "") for part in parts}

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for in the vocabulary, leading space included."""
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

    def standalone(self, token_id: int) -> str:
        """A candidate token's string on its own (top logprobs): its text, or its escaped bytes."""
        raw = self.token_bytes(token_id)
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return escape_bytes(raw)


@dataclass(frozen=True)
class TokenPiece:
    """One listed token: its id, the text it adds, and its bytes (they concatenate to the text's UTF-8)."""

    token_id: int
    text: str
    raw: bytes

    @property
    def display(self) -> str:
        """The token's string in a response: its text, or its escaped bytes while a character is open."""
        return self.text if self.text or not self.raw else escape_bytes(self.raw)


class IncrementalDetokenizer:
    """One sequence's text, token by token. The engine takes the text (`add_token`, `flush`); the server takes
    the same steps as `TokenPiece`s (`add_tokens`), which need `token_texts` for the bytes of open characters
    (a shared one saves reading the vocabulary per request)."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        token_texts: TokenTexts | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._token_texts = token_texts
        self._open_bytes = b""  # the bytes of the listed tokens whose character is still open

    @property
    def token_texts(self) -> TokenTexts:
        if self._token_texts is None:
            self._token_texts = TokenTexts(self.tokenizer)
        return self._token_texts

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int) -> str:
        """Append one generated token and return the text it completes (possibly empty)."""
        return self._step(token_id) or ""

    def flush(self) -> str:
        """At the end of generation: emit whatever is pending, even an incomplete character."""
        return self._emit(final=True) or ""

    def add_tokens(self, token_ids: list[int], final: bool = False) -> list[TokenPiece | None]:
        """`add_token` for each token (then `flush` with `final`), as one entry per token: its piece, or None
        for a token the text leaves out (a skipped special token, SentencePiece's lone leading '▁'). Fed in
        chunks, a stream gets the same pieces as fed at once."""
        pieces = [self._piece(token_id) for token_id in token_ids]
        tail = self.flush() if final and token_ids else ""
        if tail:  # a character still open at the end: the last token closes it (as U+FFFD)
            last = pieces[-1]
            pieces[-1] = TokenPiece(
                token_ids[-1], (last.text if last else "") + tail, last.raw if last else b""
            )
            self._open_bytes = b""
        return pieces

    def _piece(self, token_id: int) -> TokenPiece | None:
        text = self._step(token_id)
        if text is None:
            if self.skip_special_tokens and token_id in self.token_texts.special_ids:
                return None
            raw = self.token_texts.token_bytes(token_id)
            self._open_bytes += raw
            return TokenPiece(token_id, "", raw)
        if not text:
            return None
        encoded = text.encode()
        # The open character's first bytes were listed with the tokens before: this one adds the rest
        # (its own bytes where they did not make a character).
        if encoded.startswith(self._open_bytes):
            raw = encoded[len(self._open_bytes) :]
        else:
            raw = self.token_texts.token_bytes(token_id)
        self._open_bytes = b""
        return TokenPiece(token_id, text, raw)

    def _step(self, token_id: int) -> str | None:
        self.token_ids.append(token_id)
        return self._emit(final=False)

    def _emit(self, final: bool) -> str | None:
        """The text the tokens since the last emission add; None while it ends in an open character."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text):
            return ""
        if full_text.endswith("\ufffd") and not final:
            return None
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        if self.prefix_offset > 4 * _CONTEXT_TOKENS:  # keep the list short for long generations
            drop = self.prefix_offset
            self.token_ids = self.token_ids[drop:]
            self.prefix_offset -= drop
            self.read_offset -= drop
        return full_text[len(prefix_text) :]
