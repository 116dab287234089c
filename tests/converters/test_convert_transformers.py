"""Plain transformers runs the bundled folder like llama2.c runs the original: this pins the RoPE permutation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from strata.bundled import BUNDLED_MODEL_DIR

from .stories260k import CONTINUATION, PROMPT, PROMPT_IDS


@pytest.fixture(scope="module")
def reference(shared_models_dir: Path) -> dict:
    return json.loads((shared_models_dir / "reference_logits_once_upon_a_time.json").read_text())


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32).eval()


def test_config_round_trips() -> None:
    written = json.loads((BUNDLED_MODEL_DIR / "config.json").read_text())
    config = LlamaConfig.from_pretrained(BUNDLED_MODEL_DIR)
    loaded = config.to_dict()
    for key, value in written.items():
        if key != "dtype":
            assert loaded[key] == value, key
    assert config.dtype == torch.float32
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 10000.0}


def test_logits_match_reference(model: torch.nn.Module, reference: dict) -> None:
    assert reference["prompt_ids"] == PROMPT_IDS
    inputs = [p["input_id"] for p in reference["positions"]]
    assert inputs == (PROMPT_IDS + CONTINUATION)[: len(inputs)]
    with torch.no_grad():
        logits = model(torch.tensor([inputs])).logits[0]
    for position in reference["positions"]:
        row = logits[position["pos"]]
        top = torch.topk(row, 5)
        assert top.indices.tolist() == position["top5_ids"], position["pos"]
        torch.testing.assert_close(top.values, torch.tensor(position["top5_logits"]), rtol=0, atol=1e-2)
        assert abs(row.sum().item() - position["logits_sum"]) < 512 * 1e-2
    after_prompt = logits[len(PROMPT_IDS) - 1]
    torch.testing.assert_close(
        after_prompt, torch.tensor(reference["full_logits_after_prompt"]), rtol=0, atol=1e-2
    )


def test_greedy_generation_matches_llama2c(model: torch.nn.Module) -> None:
    tokenizer = AutoTokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    inputs = tokenizer(PROMPT, return_tensors="pt")
    assert inputs.input_ids[0].tolist() == PROMPT_IDS
    out = model.generate(**inputs, do_sample=False, max_new_tokens=55, pad_token_id=tokenizer.eos_token_id)
    assert out[0, len(PROMPT_IDS) :].tolist() == CONTINUATION
