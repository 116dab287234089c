"""Structured output, logit_bias, allowed_token_ids and bad_words on the bundled stories260K model.

Every constrained output is checked by an independent reference: `jsonschema` for JSON, `re.fullmatch`
for regexes and the grammar. The model knows nothing of JSON, so these exercise the masks, not the model.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_schemas import EBNF, EBNF_LANGUAGE, REGEXES, SCHEMAS

from strata import LLM, SamplingParams
from strata.sampling_params import SamplingParamsError, StructuredOutputsParams

from stories260k import PROMPT

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def llm() -> LLM:
    # A small KV cache, so that the batch of 32 below is preempted and recomputed on the way.
    return LLM(kv_cache_memory=40 * 20480, max_model_len=256)  # 40 blocks of 16 tokens


def constrained(seed: int | None, n: int = 1, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=0.0 if seed is None else 1.0,
        seed=seed,
        n=n,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(**spec),
    )


def texts(llm: LLM, params: list[SamplingParams]) -> list[list[tuple[str, str]]]:
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    return [[(c.text, c.finish_reason) for c in out.outputs] for out in outputs]


def test_json_schemas_greedy_and_sampled_validate_and_preemption_keeps_state(llm: LLM) -> None:
    # Greedy and several seeds of each schema in one batch of 32 requests, with an unconstrained request
    # mixed in; the small cache preempts some of them mid-way.
    params, names = [], []
    for name, schema in SCHEMAS.items():
        for seed in (None, 1, 2, 3):
            params.append(constrained(seed, json=schema, disable_any_whitespace=True))
            names.append(name)
    params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    preemptions_before = llm.stats()["num_preemptions"]
    results = texts(llm, params)
    assert llm.stats()["num_preemptions"] > preemptions_before
    for name, [(text, reason)] in zip(names, results, strict=False):
        assert reason == "stop", (name, text)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_whitespace_pattern_and_schema_as_json_text(llm: LLM) -> None:
    schema = SCHEMAS["enum"]
    params = [constrained(seed, json=json.dumps(schema), whitespace_pattern=r"[ ]?") for seed in range(4)]
    for [(text, reason)] in texts(llm, params):
        assert reason == "stop"
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_grammar_outputs_match(llm: LLM) -> None:
    choices = ["cat", "a big dog", "Lily's ball", "x"]
    params = [constrained(seed, regex=regex) for regex in REGEXES for seed in (None, 5, 6)]
    params += [constrained(seed, choice=choices) for seed in (None, 7, 8, 9)]
    params += [constrained(seed, grammar=EBNF) for seed in (None, 10, 11)]
    lark = 'start: ("yes" | "no") " " NUMBER\nNUMBER: /[1-9][0-9]?/'
    params += [constrained(seed, grammar=lark) for seed in (None, 12)]
    results = texts(llm, params)
    checks = [re.compile(regex) for regex in REGEXES for _ in range(3)]
    checks += [re.compile("|".join(re.escape(c) for c in choices))] * 4
    checks += [EBNF_LANGUAGE] * 3 + [re.compile(r"(yes|no) [1-9][0-9]?")] * 2
    for check, [(text, reason)] in zip(checks, results, strict=True):
        assert reason == "stop"
        assert check.fullmatch(text), (check.pattern, text)


def test_each_of_n_sequences_has_its_own_grammar_state(llm: LLM) -> None:
    params = constrained(3, n=4, json=SCHEMAS["required_props"], disable_any_whitespace=True)
    [outputs] = texts(llm, [params])
    assert len({text for text, _ in outputs}) > 1
    for text, reason in outputs:
        assert reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMAS["required_props"])


def test_unconstrained_requests_get_the_tokens_they_get_alone(llm: LLM) -> None:
    plain = [
        SamplingParams(temperature=0, max_tokens=40),
        SamplingParams(temperature=0.9, seed=4, max_tokens=40),
    ]
    alone = llm.generate([PROMPT, "Lily had a dog"], plain, use_tqdm=False)
    schema = SCHEMAS["nested"]
    mixed_params = [constrained(None, json=schema, disable_any_whitespace=True), plain[0]]
    mixed_params += [constrained(1, regex=REGEXES[1]), plain[1], constrained(2, choice=["a", "b"])]
    prompts = [PROMPT, PROMPT, PROMPT, "Lily had a dog", PROMPT]
    mixed = llm.generate(prompts, mixed_params, use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[3].outputs[0].token_ids == alone[1].outputs[0].token_ids
    jsonschema.validate(json.loads(mixed[0].outputs[0].text), schema)


def test_repeated_specs_compile_once(llm: LLM) -> None:
    manager = llm.engine.structured_output
    spec = StructuredOutputsParams(regex=r"[a-z]{2,4}")
    first = manager.sequence_grammar(spec)
    second = manager.sequence_grammar(StructuredOutputsParams(regex=r"[a-z]{2,4}"))
    assert first._compiled is second._compiled
    assert first.matcher() is not second.matcher()  # each sequence advances its own copy


def test_logit_bias_allowed_token_ids_and_bad_words_by_effect(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=30)
    [base] = llm.generate(PROMPT, greedy, use_tqdm=False)
    base_ids = base.outputs[0].token_ids
    tokenizer = llm.get_tokenizer()

    # A +100 bias on one token makes it the greedy choice everywhere; -100 on the first greedy token
    # moves the first step elsewhere.
    favourite = tokenizer.encode("cat", add_special_tokens=False)[-1]
    biased = SamplingParams(temperature=0, max_tokens=5, logit_bias={favourite: 100.0})
    assert llm.generate(PROMPT, biased, use_tqdm=False)[0].outputs[0].token_ids == [favourite] * 5
    avoided = SamplingParams(temperature=0, max_tokens=5, logit_bias={str(base_ids[0]): -100})
    assert llm.generate(PROMPT, avoided, use_tqdm=False)[0].outputs[0].token_ids[0] != base_ids[0]

    # Sampled, every token is one of the allowed ones.
    allowed = sorted(set(base_ids[:6]))
    only = SamplingParams(temperature=1.0, seed=0, max_tokens=30, allowed_token_ids=allowed)
    out = llm.generate(PROMPT, only, use_tqdm=False)[0].outputs[0]
    assert set(out.token_ids) <= set(allowed) and len(out.token_ids) == 30

    # A banned word never appears, though the greedy text has it.
    assert "Lily" in base.outputs[0].text
    banned = SamplingParams(temperature=0, max_tokens=30, bad_words=["Lily"])
    text = llm.generate(PROMPT, banned, use_tqdm=False)[0].outputs[0].text
    assert "Lily" not in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"json": {"type": "foo"}}, "json"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a(b"}, "regex"),
        ({"grammar": 'root ::= "yes'}, "grammar"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"choice": []}, "choice"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({}, "exactly one"),
        ({"json_object": "yes"}, "json_object"),
    ],
)
def test_invalid_specs_name_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(SamplingParamsError, match=message):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"structured_outputs": {"regex": "a", "bogus": 1}}, "unknown keys"),
        ({"structured_outputs": "json"}, "structured_outputs"),
        ({"logit_bias": {1: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": [1.0]}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1.5]}, "allowed_token_ids"),
        ({"bad_words": ["ok", ""]}, "bad_words"),
        ({"bad_words": "word"}, "bad_words"),
    ],
)
def test_invalid_masking_params_name_the_problem(kwargs: dict, message: str) -> None:
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    for params in (SamplingParams(allowed_token_ids=[1, 512]), SamplingParams(logit_bias={600: 1.0})):
        with pytest.raises(SamplingParamsError, match="outside the vocabulary"):
            llm.generate(PROMPT, params, use_tqdm=False)


def test_json_object_with_a_bias_towards_closing_it(llm: LLM) -> None:
    # The grammar's mask applies first, so the +100 on "}" only wins where the grammar allows it.
    close = llm.get_tokenizer().encode("}", add_special_tokens=False)[-1]
    params = SamplingParams(
        temperature=0,
        max_tokens=MAX_TOKENS,
        logit_bias={close: 100.0},
        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
    )
    completion = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert completion.finish_reason == "stop"
    assert json.loads(completion.text) == {}


def test_a_grammar_the_vocabulary_cannot_compile_aborts_only_its_request(llm: LLM) -> None:
    # Special tokens are checked only against a tokenizer: this validates, then fails to compile.
    broken = constrained(None, grammar='start: "a" <|no_such_token|>')
    plain = SamplingParams(temperature=0, max_tokens=10)
    outputs = llm.generate([PROMPT, PROMPT], [broken, plain], use_tqdm=False)
    assert outputs[0].outputs[0].finish_reason == "abort" and outputs[0].outputs[0].token_ids == []
    assert outputs[1].outputs[0].finish_reason == "length"
