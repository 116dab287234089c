"""Structured output on the real SmolLM2-135M-Instruct (GGUF, byte-level BPE vocabulary of 49,152 tokens),
every output checked by `jsonschema` or `re.fullmatch`, constrained and unconstrained requests in one batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from structured_schemas import EBNF, EBNF_LANGUAGE, REGEXES, SCHEMAS

from strata import LLM, SamplingParams
from strata.sampling_params import StructuredOutputsParams

from gguf_models import smollm2_gguf

MAX_TOKENS = 64


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = smollm2_gguf(tmp_path_factory.mktemp("smollm2"))
    return LLM(str(path), max_model_len=512)


def chat_prompt(llm: LLM, request: str) -> dict:
    ids = llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": request}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return {"prompt_token_ids": list(ids)}


def constrained(**spec) -> SamplingParams:
    return SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(disable_any_whitespace="json" in spec, **spec),
    )


def test_mixed_batch_every_constrained_output_validates(llm: LLM) -> None:
    plain = SamplingParams(temperature=0, max_tokens=24)
    plain_prompt = chat_prompt(llm, "What is the capital of France?")
    [alone] = llm.generate(plain_prompt, plain, use_tqdm=False)

    prompts, params, checks = [], [], []
    for schema in SCHEMAS.values():
        prompts.append(chat_prompt(llm, f"Reply with JSON matching this schema: {json.dumps(schema)}"))
        params.append(constrained(json=schema))
        checks.append(lambda text, schema=schema: jsonschema.validate(json.loads(text), schema))
    for regex in REGEXES[:2]:
        prompts.append(chat_prompt(llm, "Answer the question: is the sky blue? Then name a colour."))
        params.append(constrained(regex=regex))
        checks.append(lambda text, regex=regex: re.fullmatch(regex, text) or pytest.fail(text))
    choices = ["Paris", "London", "Berlin"]
    prompts.append(chat_prompt(llm, "Which city is the capital of France?"))
    params.append(constrained(choice=choices))
    checks.append(lambda text: text in choices or pytest.fail(text))
    prompts.append(chat_prompt(llm, "Tell me a very short story about Lily."))
    params.append(constrained(grammar=EBNF))
    checks.append(lambda text: EBNF_LANGUAGE.fullmatch(text) or pytest.fail(text))

    outputs = llm.generate([*prompts, plain_prompt], [*params, plain], use_tqdm=False)
    for check, output in zip(checks, outputs, strict=False):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        check(completion.text)
    assert outputs[-1].outputs[0].token_ids == alone.outputs[0].token_ids
