"""Logprob token strings join up to the text, for SentencePiece (the bundled model, with byte fallback) and
byte-level BPE (the real SmolLM2 tokenizer): leading spaces kept, open characters as OpenAI's bytes."""

from __future__ import annotations

from typing import Any

import pytest

from strata.engine.llm_engine import load_tokenizer
from strata.engine.token_text import TokenTexts
from strata.entrypoints.llm import default_model

from gguf_models import smollm2_gguf

TEXT = "Once upon a time, there was a café named Zoë 😀.\n\nThe end."


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "sentencepiece":
        return load_tokenizer(default_model())
    return load_tokenizer(str(smollm2_gguf(tmp_path_factory.mktemp("smollm2"))))


@pytest.mark.parametrize("text", [TEXT, "Zoë café 😀"])
def test_a_prompt_joins_up_to_its_decoded_text(tokenizer: Any, text: str) -> None:
    """Echoed prompts: the tokens join up to the decoded text; `<s>` is listed only where the text has it,
    and a lone '▁' that decoding drops at the start ("Zoë" has no '▁Z' token) is not listed."""
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(text)
    for skip_special_tokens in (True, False):
        pieces = texts.decoder(skip_special_tokens, at_start=True).feed(ids, final=True)
        listed = [piece for piece in pieces if piece is not None]
        assert "".join(piece.text for piece in listed) == tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens
        )
        assert all(piece.display for piece in listed)  # never '' for a listed token
    skipped = texts.decoder(True, at_start=True).feed(ids, final=True)
    assert all(
        piece is None for token, piece in zip(ids, skipped, strict=True) if token in tokenizer.all_special_ids
    )


def test_a_continuation_keeps_leading_spaces_and_its_bytes_join_up(tokenizer: Any) -> None:
    """What the engine streams after a prompt: every token's text with its leading space ('▁there' and
    'Ġthere' are ' there'); a token that only opens a character is `bytes:...`, and the bytes of all the
    tokens are the UTF-8 of the text."""
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode("Lily said: " + TEXT, add_special_tokens=False)
    cut = len(tokenizer.encode("Lily said:", add_special_tokens=False))
    expected = tokenizer.decode(ids)[len(tokenizer.decode(ids[:cut])) :]
    assert expected.startswith(" Once")
    pieces = [piece for piece in texts.decoder(True, at_start=False).feed(ids[cut:], final=True) if piece]
    assert "".join(piece.text for piece in pieces) == expected
    assert b"".join(piece.raw for piece in pieces) == expected.encode()
    assert pieces[0].display.startswith(" ") and " there" in [piece.display for piece in pieces]
    split = [piece for piece in pieces if not is_utf8(piece.raw)]
    assert split, "the emoji spans tokens in both tokenizers"
    for piece in split:
        if not piece.text:
            assert piece.display == "bytes:" + "".join(f"\\x{b:02x}" for b in piece.raw)


def is_utf8(raw: bytes) -> bool:
    try:
        raw.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_a_stream_fed_in_chunks_gives_the_same_pieces(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    whole = texts.decoder(True, at_start=False).feed(ids, final=True)
    decoder = texts.decoder(True, at_start=False)
    chunked = [
        piece
        for start in range(0, len(ids), 3)
        for piece in decoder.feed(ids[start : start + 3], final=start + 3 >= len(ids))
    ]
    assert chunked == whole


def test_candidates_standalone(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    there = tokenizer.encode(" there", add_special_tokens=False)[-1]
    assert texts.standalone(there).endswith("there")
    assert texts.standalone(there).startswith(" ") or tokenizer.decode([there]) == "there"
