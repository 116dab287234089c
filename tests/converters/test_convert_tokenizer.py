"""The converted tokenizer encodes exactly like llama2.c's `encode()` and decodes back to the input."""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from strata.converters.llama2c import read_llama2c_tokenizer
from strata.converters.sentencepiece_bpe import derive_merges

from .stories260k import CONTINUATION, PROMPT, PROMPT_IDS, STORY

SPECIAL_LITERALS = ("<s>", "</s>", "<unk>")

WORDS = [
    "once", "upon", "a", "time", "there", "was", "little", "girl", "named", "Lily", "she", "loved", "to", "play",
    "outside", "in", "the", "park", "One", "day", "saw", "big", "red", "ball", "wanted", "with", "it", "but",
    "too", "high", "Tom", "and", "Sue", "said", "happy", "dog", "cat", "tree", "friends", "The", "mom", "asked",
    "why", "something", "everyone", "jumped", "quickly",
]  # fmt: skip
PUNCTUATION = list(".,!?;:'\"-()[]{}<>/\\|@#$%^&*_+=~`")
UNICODE = [
    "中文", "日本語", "한국어", "😀", "👩‍👩‍👧", "🇫🇷", "e\u0301", "a\u0308\u0323", "Ω", "ß", "ñ", "é", "’", "“",
    "”", "—", "…", "\u00a0", "\u200a", "\t", "\r\n", "€", "™", "Ѐ", "ع", "\u0007", "<0x41>", "<0xZZ>",
]  # fmt: skip
SEPARATORS = [" ", " ", " ", "", "  ", "\n", "\n\n", " \n ", "\t"]


class Llama2cEncoder:
    """A faithful Python port of llama2.c's `encode()` (run.c), reading tokenizer.bin directly."""

    def __init__(self, path: Path) -> None:
        data = path.read_bytes()
        self.vocab: list[bytes] = []
        self.scores: list[float] = []
        offset = 4
        while offset < len(data):
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            self.vocab.append(data[offset : offset + length])
            self.scores.append(score)
            offset += length
        self.lookup = {piece: i for i, piece in enumerate(self.vocab)}

    def encode(self, text: str, bos: bool = True) -> list[int]:
        data = text.encode("utf-8")
        assert b"\0" not in data, "a C string ends at NUL"
        tokens = [1] if bos else []
        if data:  # the dummy prefix: SentencePiece's add_dummy_prefix
            tokens.append(self.lookup[b" "])
        buffer = b""
        for i, byte in enumerate(data):
            if byte & 0xC0 != 0x80:  # not a continuation byte: a new codepoint starts
                buffer = b""
            buffer += bytes([byte])
            if i + 1 < len(data) and data[i + 1] & 0xC0 == 0x80 and len(buffer) < 4:
                continue
            if buffer in self.lookup:
                tokens.append(self.lookup[buffer])
            else:  # byte fallback: the first 3 ids are <unk>, <s>, </s>
                tokens.extend(b + 3 for b in buffer)
            buffer = b""
        while True:  # merge the best-scoring adjacent pair, leftmost on ties, until none is in the vocab
            best_score, best_id, best_idx = -1e10, -1, -1
            for i in range(len(tokens) - 1):
                merged = self.lookup.get(self.vocab[tokens[i]] + self.vocab[tokens[i + 1]])
                if merged is not None and self.scores[merged] > best_score:
                    best_score, best_id, best_idx = self.scores[merged], merged, i
            if best_idx == -1:
                return tokens
            tokens[best_idx : best_idx + 2] = [best_id]


def random_text(rng: random.Random) -> str:
    parts: list[str] = []
    for _ in range(rng.randint(0, 14)):
        kind = rng.random()
        if kind < 0.5:
            word = rng.choice(WORDS)
            parts.append(word.capitalize() if rng.random() < 0.2 else word)
        elif kind < 0.6:
            parts.append(str(rng.randint(0, 10 ** rng.randint(1, 9))))
        elif kind < 0.75:
            parts.append(rng.choice(PUNCTUATION) * rng.randint(1, 3))
        elif kind < 0.9:
            parts.append(rng.choice(UNICODE))
        else:
            parts.append(random_codepoint(rng))
        parts.append(rng.choice(SEPARATORS))
    text = "".join(parts)
    if rng.random() < 0.3:
        text = " " * rng.randint(1, 3) + text
    return text


def random_codepoint(rng: random.Random) -> str:
    while True:
        cp = rng.randint(1, 0x10FFFF)
        # Surrogates are not text; U+2581 is SentencePiece's space (see test_sentencepiece_space_symbol).
        if not 0xD800 <= cp <= 0xDFFF and cp != 0x2581:
            return chr(cp)


def comparable_strings(shared_models_dir: Path) -> list[str]:
    rng = random.Random(260)
    edge_cases = [
        "", " ", "  ", "\n", " \n", "hello", " hello", "hello ", "  hello  world  ", "Lily's ball!",
        "1234567890", "3.14159 + 2 = 5.14159", "a\nb\n\nc", "\t tab", "!!!???...", "<0x41><0x00>",
        "Ünïcödé ñ é", "中文字符 and English", "emoji 😀👍🏽👩‍👩‍👧 mix", "cafe\u0301 combining",
        "\u00a0non-breaking\u00a0spaces", "’“”—…", PROMPT, STORY,
        (shared_models_dir / "reference_greedy_bos_256.txt").read_text(encoding="utf-8"),
    ]  # fmt: skip
    texts = edge_cases + [random_text(rng) for _ in range(400)]
    return [t for t in texts if not any(s in t for s in SPECIAL_LITERALS)]


@pytest.fixture(scope="module")
def tokenizer(llama2c_folder: Path) -> Tokenizer:
    return Tokenizer.from_file(str(llama2c_folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_tokenizer(llama2c_folder: Path):
    return AutoTokenizer.from_pretrained(llama2c_folder)


def test_prompt_ids_and_greedy_story_decode(tokenizer: Tokenizer, hf_tokenizer) -> None:
    assert tokenizer.encode(PROMPT).ids == PROMPT_IDS
    assert hf_tokenizer(PROMPT).input_ids == PROMPT_IDS
    # The 55 tokens end inside "high"; llama2.c's next token (415, 'h') completes it.
    ids = PROMPT_IDS + CONTINUATION
    assert tokenizer.decode(ids) == STORY.removesuffix("h")
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == STORY.removesuffix("h")
    assert tokenizer.decode([*ids, 415]) == STORY


def test_encodes_exactly_like_llama2c(shared_models_dir: Path, tokenizer: Tokenizer, hf_tokenizer) -> None:
    reference = Llama2cEncoder(shared_models_dir / "tok512.bin")
    assert reference.encode(PROMPT) == PROMPT_IDS  # the port agrees with run.c on the known case
    texts = comparable_strings(shared_models_dir)
    assert len(texts) > 350
    for text in texts:
        expected = reference.encode(text)
        assert tokenizer.encode(text).ids == expected, text
        assert hf_tokenizer(text).input_ids == expected, text


def test_round_trips_arbitrary_unicode(shared_models_dir: Path, tokenizer: Tokenizer, hf_tokenizer) -> None:
    rng = random.Random(7)
    texts = [*comparable_strings(shared_models_dir), "\0nul\0", "\x7f\x1b[0m"]
    texts += ["".join(random_codepoint(rng) for _ in range(rng.randint(1, 20))) for _ in range(200)]
    for text in texts:
        ids = tokenizer.encode(text).ids
        assert tokenizer.decode(ids) == text, text
        assert hf_tokenizer.decode(ids, skip_special_tokens=True) == text, text


def test_unknown_characters_go_through_byte_fallback(tokenizer: Tokenizer) -> None:
    text = "中文😀"  # none of these is a piece of the 512-token vocabulary
    ids = tokenizer.encode(text).ids
    assert ids[:2] == [1, 410]  # BOS, the dummy-prefix space
    assert ids[2:] == [b + 3 for b in text.encode("utf-8")]
    assert tokenizer.decode(ids) == text
    # A lone byte that is not UTF-8 on its own decodes to U+FFFD (transformers' ByteFallback behaviour).
    assert tokenizer.decode([1, 0xE4 + 3]) == "\ufffd"


def test_sentencepiece_space_symbol(shared_models_dir: Path, tokenizer: Tokenizer) -> None:
    # Known, deliberate difference: like SentencePiece (and every HF Llama tokenizer), U+2581 in the input is
    # the space piece; llama2.c's vocabulary spells spaces ' ', so it byte-encodes U+2581 instead.
    assert tokenizer.encode("a\u2581b").ids == tokenizer.encode("a b").ids
    assert Llama2cEncoder(shared_models_dir / "tok512.bin").encode("a\u2581b") != tokenizer.encode("a b").ids


def test_special_tokens(tokenizer: Tokenizer, hf_tokenizer) -> None:
    assert (hf_tokenizer.bos_token, hf_tokenizer.eos_token, hf_tokenizer.unk_token) == (
        "<s>",
        "</s>",
        "<unk>",
    )
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.unk_token_id) == (1, 2, 0)
    assert hf_tokenizer.pad_token_id is None or 0 <= hf_tokenizer.pad_token_id < 512
    assert tokenizer.encode("").ids == [1]
    assert tokenizer.encode(PROMPT, add_special_tokens=False).ids == PROMPT_IDS[1:]
    # Like every HF Llama tokenizer, the special-token literals in text map to their ids.
    assert tokenizer.encode("a</s>").ids == [1, 261, 2]
    assert hf_tokenizer.decode([1, *PROMPT_IDS[1:], 2]) == "<s> " + PROMPT + "</s>"


def test_autotokenizer_loads_tokenizer_json_unchanged(llama2c_folder: Path, hf_tokenizer) -> None:
    assert type(hf_tokenizer).__name__ == "TokenizersBackend"
    on_disk = json.loads((llama2c_folder / "tokenizer.json").read_text(encoding="utf-8"))
    loaded = json.loads(hf_tokenizer.backend_tokenizer.to_str())
    for part in ("normalizer", "pre_tokenizer", "model", "decoder", "post_processor", "added_tokens"):
        assert loaded[part] == on_disk[part], part
    config = json.loads((llama2c_folder / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["add_bos_token"] is True
    assert hf_tokenizer.model_max_length == 512


def test_merges_follow_piece_scores(llama2c_folder: Path, shared_models_dir: Path) -> None:
    vocab = read_llama2c_tokenizer(shared_models_dir / "tok512.bin")
    merges = derive_merges(vocab)
    index = {piece: i for i, piece in enumerate(vocab.pieces)}
    scores = [vocab.scores[index[left + right]] for left, right in merges]
    assert scores == sorted(scores, reverse=True)
    assert merges[0] == ("\u2581", "t")  # piece 259, the best-scoring merge
    model = json.loads((llama2c_folder / "tokenizer.json").read_text(encoding="utf-8"))["model"]
    assert [tuple(m) for m in model["merges"]] == merges
