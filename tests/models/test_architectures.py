"""Every supported decoder-only architecture matches transformers' own eager forward pass.

Strata runs the HF modeling code with its paged attention; the reference is the same weights run by
transformers with `attn_implementation="eager"` over the whole sequence, no cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from strata import LLM, SamplingParams

from tiny_models import TINY_CONFIGS

PROMPT_LEN = 21  # longer than the tiny configs' sliding window
DECODE_STEPS = 16


def _record_logits(llm: LLM) -> list[torch.Tensor]:
    """Keep a copy of the logits each step samples from (the real runner still does all the work)."""
    runner = llm.engine.runner
    execute = runner.execute
    recorded: list[torch.Tensor] = []

    def execute_and_record(scheduled):
        output = execute(scheduled)
        recorded.append(output.logits[output.sample_rows].clone())
        return output

    runner.execute = execute_and_record
    return recorded


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_logits_and_greedy_match_transformers(arch: str, tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tiny_model_dir(arch)
    prompt = torch.randint(3, 128, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()
    reference = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="eager", dtype=torch.float32
    ).eval()

    llm = LLM(str(folder), skip_tokenizer_init=True, block_size=4)
    recorded = _record_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=DECODE_STEPS + 1, ignore_eos=True)
    output = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]

    # Prefill, then one decode step per generated token: logits equal HF's at the same positions.
    full = torch.tensor([prompt + output.token_ids[:-1]])
    with torch.no_grad():
        expected = reference(full).logits[0, PROMPT_LEN - 1 :]
    actual = torch.cat(recorded)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)

    # Greedy over 32 tokens equals transformers' generate (both stop at the config's EOS, if it comes).
    greedy = SamplingParams(temperature=0.0, max_tokens=32)
    tokens = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False)[0].outputs[0].token_ids
    generation = GenerationConfig(do_sample=False, max_new_tokens=32, eos_token_id=2, pad_token_id=0)
    with torch.no_grad():
        hf_tokens = reference.generate(torch.tensor([prompt]), generation_config=generation)[
            0, PROMPT_LEN:
        ].tolist()
    assert tokens == hf_tokens
