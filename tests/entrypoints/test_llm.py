"""The offline `LLM` API on the bundled real model, checked against llama2.c's outputs and HF's forward."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from strata import LLM, SamplingParams

from stories260k import GREEDY_55, GREEDY_55_TEXT, PROMPT, PROMPT_IDS


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM()  # the bundled stories260K model


def test_greedy_matches_llama2c(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=55), use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPT_IDS
    assert out.outputs[0].token_ids == GREEDY_55
    assert PROMPT + out.outputs[0].text == GREEDY_55_TEXT
    assert out.outputs[0].finish_reason == "length"
    assert out.finished


def test_logprobs_match_transformers(llm: LLM, bundled_model_dir: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, prompt_logprobs=3)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    reference = AutoModelForCausalLM.from_pretrained(bundled_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT_IDS + completion.token_ids])
    with torch.no_grad():
        expected = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)
    assert len(completion.logprobs) == 8
    for step, (token, entry) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        row = expected[len(PROMPT_IDS) - 1 + step]
        assert entry[token].rank == 1  # greedy picks the top token
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = torch.topk(row, 5)
        assert list(entry)[:5] == top.indices.tolist()
        for logprob, token_id in zip(top.values.tolist(), top.indices.tolist(), strict=True):
            assert entry[token_id].logprob == pytest.approx(logprob, abs=1e-4)
    assert completion.cumulative_logprob == pytest.approx(
        sum(
            entry[token].logprob
            for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
        )
    )
    # Each token's decoded_token is its own text, leading space kept: they join up to the output text.
    assert (
        "".join(
            entry[token].decoded_token
            for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
        )
        == completion.text
    )
    assert any(
        entry[token].decoded_token.startswith(" ")
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True)
    )
    # Prompt logprobs: None for the first token, then the logprob of each actual next prompt token.
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(PROMPT_IDS)
    for position in range(1, len(PROMPT_IDS)):
        entry = out.prompt_logprobs[position]
        token = PROMPT_IDS[position]
        row = expected[position - 1]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert len(entry) in (3, 4)  # top-3 plus the actual token when it is not among them


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=42)
    alone = llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.generate(PROMPT, seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == again
    others = SamplingParams(temperature=1.0, max_tokens=30)
    mixed = llm.generate(
        ["Lily had a dog", PROMPT, "The sun", PROMPT],
        [others, seeded, others, SamplingParams(temperature=0)],
        use_tqdm=False,
    )
    assert mixed[1].outputs[0].token_ids == alone
    different_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=20, seed=43)
    assert llm.generate(PROMPT, different_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_top_k_one_equals_greedy(llm: LLM) -> None:
    top1 = SamplingParams(temperature=1.5, top_k=1, max_tokens=55)
    assert llm.generate(PROMPT, top1, use_tqdm=False)[0].outputs[0].token_ids == GREEDY_55


def test_stop_strings_cut_exactly(llm: LLM) -> None:
    full = GREEDY_55_TEXT.removeprefix(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=55, stop=["Lily"]), use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.text == full[: full.index("Lily")]
    assert completion.finish_reason == "stop" and completion.stop_reason == "Lily"
    kept = SamplingParams(
        temperature=0, max_tokens=55, stop=["park.", "ball"], include_stop_str_in_output=True
    )
    completion = llm.generate(PROMPT, kept, use_tqdm=False)[0].outputs[0]
    assert completion.text == full[: full.index("park.") + len("park.")]
    assert completion.stop_reason == "park."
    by_id = SamplingParams(temperature=0, max_tokens=55, stop_token_ids=[GREEDY_55[10]])
    completion = llm.generate(PROMPT, by_id, use_tqdm=False)[0].outputs[0]
    assert completion.token_ids == GREEDY_55[:11]
    assert completion.stop_reason == GREEDY_55[10]


def test_n_gives_independent_outputs(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=5), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 16 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_greedy_from_bos_matches_llama2c_reference(llm: LLM, shared_models_dir: Path) -> None:
    reference = (shared_models_dir / "reference_greedy_bos_256.txt").read_text()
    # llama2.c ran 256 steps from BOS, printing the token each step sampled.
    params = SamplingParams(temperature=0, max_tokens=256)
    completion = llm.generate({"prompt_token_ids": [1]}, params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 256
    assert completion.text == reference.removesuffix("\n")


def test_ignore_eos_runs_to_max_tokens(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    completion = llm.generate({"prompt_token_ids": [1]}, params, use_tqdm=False)[0].outputs[0]
    assert len(completion.token_ids) == 300 and completion.finish_reason == "length"


def test_context_limit_ends_with_length(llm: LLM) -> None:
    small = LLM(max_model_len=16)
    completion = small.generate(PROMPT, SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)[
        0
    ].outputs[0]
    assert len(completion.token_ids) == 16 - len(PROMPT_IDS)
    assert completion.finish_reason == "length"


def test_apply_model_and_tokenizer(llm: LLM) -> None:
    assert llm.apply_model(lambda model: type(model).__name__) == "LlamaForCausalLM"
    assert llm.get_tokenizer().encode(PROMPT) == PROMPT_IDS


def test_chat_uses_the_template_or_says_there_is_none(llm: LLM) -> None:
    messages = [{"role": "user", "content": PROMPT}]
    with pytest.raises(ValueError, match="no chat template"):
        llm.chat(messages, use_tqdm=False)
    template = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}{% endfor %}"
    params = SamplingParams(temperature=0, max_tokens=55)
    out = llm.chat(messages, params, use_tqdm=False, chat_template=template)[0]
    assert out.prompt_token_ids == PROMPT_IDS
    assert out.outputs[0].token_ids == GREEDY_55
    both = llm.chat(
        [messages, [{"role": "user", "content": "Lily"}]], params, use_tqdm=False, chat_template=template
    )
    assert len(both) == 2 and both[0].outputs[0].token_ids == GREEDY_55


def test_chat_describes_tools_through_the_template(llm: LLM) -> None:
    """`tools` reach the template, which writes them into the prompt."""
    template = "{% for tool in tools %}{{ tool.function.name }}. {% endfor %}{{ messages[0]['content'] }}"
    tools = [{"type": "function", "function": {"name": "Lily", "parameters": {"type": "object"}}}]
    params = SamplingParams(temperature=0, max_tokens=4)
    out = llm.chat([{"role": "user", "content": PROMPT}], params, False, template, tools=tools)[0]
    assert out.prompt_token_ids == llm.get_tokenizer().encode(f"Lily. {PROMPT}", add_special_tokens=False)


def test_engine_seed_makes_unseeded_sampling_reproducible() -> None:
    params = SamplingParams(temperature=1.0, max_tokens=24)
    first = LLM(seed=7).generate([PROMPT] * 3, params, use_tqdm=False)
    second = LLM(seed=7).generate([PROMPT] * 3, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    assert len({tuple(o.outputs[0].token_ids) for o in first}) > 1  # the rows still differ from each other


def test_bfloat16_runs_close_to_float32(llm: LLM) -> None:
    low = LLM(dtype="bfloat16")
    assert low.apply_model(lambda model: model.lm_head.weight.dtype) == torch.bfloat16
    out = low.generate(PROMPT, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert out.outputs[0].token_ids[:4] == GREEDY_55[:4]
