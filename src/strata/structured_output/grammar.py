"""`StructuredOutputsParams` in the grammar engine's format, validated, cached by (kind, spec).

The grammar engine is llguidance. Measured against xgrammar 0.2.9 (docs/structured-output.md has the
figures), both compile a schema in milliseconds and fill the masks of 32 rows over SmolLM2's 49,152-token
vocabulary in about 1-2 ms; llguidance was chosen because it has no dependencies (xgrammar requires triton
and apache-tvm-ffi, and triton is a GPU compiler a CPU install should not pull in beside torch) and reads
Lark and GBNF grammars, regexes and JSON schemas natively.
"""

from __future__ import annotations

import functools
import json

from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark

from strata.sampling_params import GrammarKey, SamplingParamsError

# Distinct specs whose translation is kept; a server sees a handful of schemas over and over.
_CACHE_SIZE = 1024


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _text_grammar(kind: str, spec: str) -> str:
    """The llguidance grammar of a regex, a list of choices (as JSON text) or a GBNF/Lark grammar."""
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        # One Lark alternative per choice; a JSON string literal is a valid Lark string literal.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in json.loads(spec)))
    return LLMatcher.grammar_from_lark(any_to_lark(spec))  # GBNF is converted, Lark kept


def grammar_text(key: GrammarKey) -> str:
    """The llguidance grammar for `StructuredOutputsParams.key`; raises `SamplingParamsError` naming the
    problem when the schema, regex or grammar is invalid. Needs no tokenizer, so it runs at validation."""
    kind, spec, whitespace = key
    if kind in ("json", "json_object"):
        options = None
        if whitespace == "":
            options = {"whitespace_flexible": False}
        elif whitespace is not None:
            options = {"whitespace_pattern": whitespace}
        schema = spec if kind == "json" else '{"type": "object"}'
        try:
            text = LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as exc:
            raise SamplingParamsError(f"structured_outputs.json is not a valid JSON schema: {exc}") from exc
    elif kind in ("regex", "choice", "grammar"):
        # llguidance reports a bad regex or grammar as a bare Exception (from its Rust core).
        try:
            text = _text_grammar(kind, spec)
        except Exception as exc:
            raise SamplingParamsError(f"structured_outputs.{kind} is not valid: {exc}") from exc
    else:
        raise SamplingParamsError(f"unknown structured output kind {kind!r}")
    is_error, messages = LLMatcher.validate_grammar_with_warnings(text)
    if is_error:
        raise SamplingParamsError(f"structured_outputs.{kind} is invalid: {messages[0].strip()}")
    return text
