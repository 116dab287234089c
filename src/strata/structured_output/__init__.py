"""Structured output: a request's JSON schema, regex, choice or grammar turned into per-step token masks.

`grammar.py` translates `StructuredOutputsParams` into the grammar engine's format (and validates it);
`manager.py` compiles grammars per engine, keeps each sequence's matcher and fills the step's masks.
"""

from strata.structured_output.grammar import grammar_text
from strata.structured_output.manager import (
    GrammarMasks,
    SequenceGrammar,
    StructuredOutputError,
    StructuredOutputManager,
)

__all__ = [
    "GrammarMasks",
    "SequenceGrammar",
    "StructuredOutputError",
    "StructuredOutputManager",
    "grammar_text",
]
