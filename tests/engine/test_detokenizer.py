"""Incremental detokenisation never splits a character and adds up to the full decode."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from strata.engine.detokenizer import IncrementalDetokenizer


def _stream(tokenizer, prompt: list[int], output: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    pieces = [detokenizer.add_token(token) for token in output]
    pieces.append(detokenizer.flush())
    return pieces


def _expected(tokenizer, prompt: list[int], output: list[int]) -> str:
    full = tokenizer.decode(prompt + output, skip_special_tokens=True)
    return full[len(tokenizer.decode(prompt, skip_special_tokens=True)) :]


def test_multibyte_characters_are_never_split(bundled_model_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir)
    text = "Lily saw 猫 and 🐶! Ça va? naïve café — done"
    ids = tokenizer.encode(text)
    prompt, output = ids[:4], ids[4:]
    pieces = _stream(tokenizer, prompt, output)
    assert "".join(pieces) == _expected(tokenizer, prompt, output)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "猫" in pieces and "🐶" in pieces  # byte-fallback characters arrive whole


def test_random_token_streams_add_up_to_the_full_decode(bundled_model_dir) -> None:
    """Random pieces mixed with byte-fallback characters (valid UTF-8, as a model emits them)."""
    tokenizer = AutoTokenizer.from_pretrained(bundled_model_dir)
    generator = torch.Generator().manual_seed(0)
    alphabet = "abc xyz.,!?\n猫犬🐶🙂éüßЖж"
    for _ in range(20):
        ids: list[int] = []
        for _ in range(12):
            if torch.rand((), generator=generator) < 0.5:
                ids.append(int(torch.randint(259, tokenizer.vocab_size, (), generator=generator)))
            else:
                picks = torch.randint(0, len(alphabet), (3,), generator=generator).tolist()
                ids.extend(tokenizer.encode("".join(alphabet[i] for i in picks), add_special_tokens=False))
        prompt, output = [1, *ids[:3]], ids[3:]
        assert "".join(_stream(tokenizer, prompt, output)) == _expected(tokenizer, prompt, output)
