"""JSON schemas, regexes and a grammar for the structured-output tests, each with an independent check."""

from __future__ import annotations

import re

# Strings are bounded (maxLength) so a small model that never closes a quote still ends within max_tokens.
NAME = {"type": "string", "minLength": 1, "maxLength": 12}

SCHEMAS: dict[str, dict] = {
    "required_props": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}},
        "required": ["color", "size"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "pet": {
                "type": "object",
                "properties": {"kind": {"enum": ["cat", "dog"]}, "happy": {"type": "boolean"}},
                "required": ["kind", "happy"],
                "additionalProperties": False,
            },
            "owner": NAME,
        },
        "required": ["pet", "owner"],
        "additionalProperties": False,
    },
    "number_range": {
        "type": "object",
        "properties": {
            "score": {"type": "number", "minimum": -1.5, "maximum": 2.5},
            "count": {"type": "integer", "exclusiveMinimum": 3, "maximum": 9},
        },
        "required": ["score", "count"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "any_of": {
        "anyOf": [
            {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["x"],
                "additionalProperties": False,
            },
            {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4},
        ]
    },
}

REGEXES = [r"[a-z]{3}-[0-9]{2}", r"(yes|no), [A-Z][a-z]{1,8}\.", r"\d{1,3}(\.\d\d)?"]

# A small EBNF (GBNF) grammar and a regex that accepts exactly its language.
EBNF = 'root ::= subject " " verb "."\nsubject ::= "Lily" | "Tom"\nverb ::= "ran" | "sat" | "sang"'
EBNF_LANGUAGE = re.compile(r"(Lily|Tom) (ran|sat|sang)\.")
