"""Logprob token strings (the detokenizer's pieces) join up to the text, for SentencePiece (the bundled model,
with byte fallback), byte-level BPE (the real SmolLM2 tokenizer) and a WordPiece tokenizer whose decode cleans
up spaces: leading spaces kept, open characters as OpenAI's bytes, and always the engine's own text."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from strata.engine.detokenizer import IncrementalDetokenizer, TokenPiece, TokenTexts
from strata.engine.llm_engine import load_tokenizer
from strata.entrypoints.llm import default_model

from gguf_models import smollm2_gguf

TEXT = "Once upon a time, there was a café named Zoë 😀.\n\nThe end."


def cleanup_tokenizer() -> Any:
    """A WordPiece tokenizer trained here, with `clean_up_tokenization_spaces`: its decode joins tokens with
    spaces and then removes those before punctuation ('hello , world .' is 'hello, world.')."""
    corpus = [
        "Once upon a time, there was a cat named Tom. He said: hello, world! Is it nice? Yes.",
        "Lily saw a big dog (a brown one) and ran; the dog ran too - fast!",
    ]
    model = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    model.normalizer = normalizers.BertNormalizer(lowercase=False)
    model.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    model.decoder = decoders.WordPiece()
    model.train_from_iterator(
        corpus, trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "[CLS]"])
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=model, unk_token="[UNK]", cls_token="[CLS]", clean_up_tokenization_spaces=True
    )


@pytest.fixture(scope="module")
def smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return load_tokenizer(str(smollm2_gguf(tmp_path_factory.mktemp("smollm2"))))


def _load(request: pytest.FixtureRequest) -> Any:
    if request.param == "sentencepiece":
        return load_tokenizer(default_model())
    if request.param == "byte-level":
        return request.getfixturevalue("smollm2_tokenizer")
    return cleanup_tokenizer()


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return _load(request)


@pytest.fixture(scope="module", params=["sentencepiece", "byte-level", "cleanup"])
def any_tokenizer(request: pytest.FixtureRequest) -> Any:
    return _load(request)


@pytest.mark.parametrize("text", [TEXT, "Zoë café 😀"])
def test_a_prompt_joins_up_to_its_decoded_text(tokenizer: Any, text: str) -> None:
    """Echoed prompts: the tokens join up to the decoded text; `<s>` is listed only where the text has it,
    and a lone '▁' that decoding drops at the start ("Zoë" has no '▁Z' token) is not listed."""
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(text)
    for skip_special_tokens in (True, False):
        pieces = IncrementalDetokenizer(tokenizer, [], skip_special_tokens, texts).add_tokens(ids, final=True)
        listed = [piece for piece in pieces if piece is not None]
        assert "".join(piece.text for piece in listed) == tokenizer.decode(
            ids, skip_special_tokens=skip_special_tokens
        )
        assert all(piece.display for piece in listed)  # never '' for a listed token
    skipped = IncrementalDetokenizer(tokenizer, [], True, texts).add_tokens(ids, final=True)
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
    detokenizer = IncrementalDetokenizer(tokenizer, ids[:cut], True, texts)
    pieces = [piece for piece in detokenizer.add_tokens(ids[cut:], final=True) if piece]
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
    whole = IncrementalDetokenizer(tokenizer, [], True, texts).add_tokens(ids, final=True)
    decoder = IncrementalDetokenizer(tokenizer, [], True, texts)
    chunked = [
        piece
        for start in range(0, len(ids), 3)
        for piece in decoder.add_tokens(ids[start : start + 3], final=start + 3 >= len(ids))
    ]
    assert chunked == whole


def test_candidates_standalone(tokenizer: Any) -> None:
    texts = TokenTexts(tokenizer)
    there = tokenizer.encode(" there", add_special_tokens=False)[-1]
    assert texts.standalone(there).endswith("there")
    assert texts.standalone(there).startswith(" ") or tokenizer.decode([there]) == "there"


def engine_text(tokenizer: Any, prompt: list[int], output: list[int], skip_special_tokens: bool) -> str:
    """A sequence's output text as the engine builds it: `add_token` per token, `flush` when it finishes."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens)
    return "".join(detokenizer.add_token(token) for token in output) + detokenizer.flush()


def streamed_pieces(
    tokenizer: Any,
    texts: TokenTexts,
    prompt: list[int],
    output: list[int],
    skip_special_tokens: bool,
    chunk: int,
) -> list[TokenPiece | None]:
    """The pieces as the server lists them for a stream: a detokenizer built from the request's prompt ids,
    fed the tokens `chunk` at a time, the last chunk final."""
    detokenizer = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens, texts)
    return [
        piece
        for start in range(0, len(output), chunk)
        for piece in detokenizer.add_tokens(output[start : start + chunk], final=start + chunk >= len(output))
    ]


def test_the_pieces_are_the_engine_text_cut_at_its_tokens(any_tokenizer: Any) -> None:
    """Natural text: the pieces join up to the engine's text, which is the tokenizer's decode of the output
    after the prompt (spaces before punctuation cleaned up where the tokenizer does that), and their bytes to
    its UTF-8. Random tokens (open characters, special tokens, '##' pieces): still the engine's text."""
    tokenizer = any_tokenizer
    texts = TokenTexts(tokenizer)
    generator = torch.Generator().manual_seed(0)
    natural = tokenizer.encode(
        "Lily said: " + TEXT + " Tom said: hello, world! Is it nice? Yes (a dog) - fast!"
    )
    cases = [(natural[:cut], natural[cut:], True) for cut in (1, 2, 4, 9)]
    for _ in range(12):
        ids = torch.randint(0, len(tokenizer), (16,), generator=generator).tolist()
        cases.append((ids[:4], ids[4:], False))
    for prompt, output, is_natural in cases:
        for skip_special_tokens in (True, False):
            text = engine_text(tokenizer, prompt, output, skip_special_tokens)
            for chunk in (1, 3, len(output)):
                pieces = streamed_pieces(tokenizer, texts, prompt, output, skip_special_tokens, chunk)
                assert len(pieces) == len(output)
                listed = [piece for piece in pieces if piece is not None]
                assert "".join(piece.text for piece in listed) == text
                if is_natural:
                    assert all(piece.display for piece in listed)
                    assert b"".join(piece.raw for piece in listed) == text.encode()
            if is_natural:
                decode = tokenizer.decode
                full = decode(prompt + output, skip_special_tokens=skip_special_tokens)
                assert text == full[len(decode(prompt, skip_special_tokens=skip_special_tokens)) :]
