"""Per engine: the grammar engine's tokenizer, compiled grammars, each sequence's matcher, the step's masks.

Grammars compile on a background thread (llguidance drops the GIL while it compiles), started when a
request is added, so the compile overlaps the request's prefill instead of stalling a step; compiled
grammars are kept by `StructuredOutputsParams.key`, and each sequence starts from a copy of one.

A sequence's matcher advances by every token the sequence samples. Preemption needs no rollback: a
preempted sequence keeps its tokens and only recomputes their KV cache, so its matcher state stays valid.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch

from strata.sampling_params import GrammarKey, StructuredOutputsParams
from strata.structured_output.grammar import grammar_text

logger = logging.getLogger("strata.structured_output")

# Compiled grammars kept per engine (each holds its token-level automaton, a few hundred KB at most).
_MAX_COMPILED = 256
# float32 -inf (0xFF800000) as an int32.
_NEG_INF_BITS = np.frombuffer(np.float32(-np.inf).tobytes(), dtype=np.int32)[0]


class StructuredOutputError(RuntimeError):
    """A grammar that validated without a tokenizer failed to compile against the engine's vocabulary."""


@dataclass
class GrammarMasks:
    """What each constrained row of one sampling step adds to its logits: -inf for a token its grammar
    does not allow, else 0 (an addition is several times cheaper than a masked fill over the vocabulary)."""

    rows: list[int]  # rows of the batch, ascending
    bias: torch.Tensor  # float32 [len(rows), vocab_size]


def banned_bias(banned: np.ndarray) -> np.ndarray:
    """float32 -inf where `banned` (0/1 of any integer type) is 1, else 0: each 1 times -inf's bit pattern,
    without a multiplication that would give NaN for 0 * -inf."""
    return (banned.astype(np.int32) * _NEG_INF_BITS).view(np.float32)


class SequenceGrammar:
    """One sequence's matcher: created from its compiled grammar on first use, advanced token by token."""

    def __init__(self, compiled: Future[llguidance.LLMatcher]) -> None:
        self._compiled = compiled
        self._matcher: llguidance.LLMatcher | None = None

    def matcher(self) -> llguidance.LLMatcher:
        """The live matcher; waits for the compile if it has not finished (raises StructuredOutputError)."""
        if self._matcher is None:
            try:
                template = self._compiled.result()
            except Exception as exc:
                raise StructuredOutputError(f"the grammar failed to compile: {exc}") from exc
            if template.is_error():
                raise StructuredOutputError(f"the grammar failed to compile: {template.get_error()}")
            self._matcher = template.deep_copy()
        return self._matcher

    def accept(self, token: int) -> bool:
        """Advance by the sampled token; True when the grammar has ended (nothing but EOS may follow, and
        EOS was taken, or the grammar allows no more tokens)."""
        matcher = self.matcher()
        if not matcher.consume_token(token):
            # The mask allowed only grammar tokens, so this is a bug in the engine or the grammar engine.
            logger.error("token %d was refused by its grammar: %s", token, matcher.get_error())
            return True
        return matcher.is_stopped()


class StructuredOutputManager:
    """Compiles grammars for one engine's tokenizer and fills the per-step masks of its constrained rows."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: frozenset[int]) -> None:
        self.vocab_size = vocab_size
        self._hf_tokenizer = tokenizer
        self._eos = sorted(t for t in eos_token_ids if t < vocab_size)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="strata-grammar")
        # Built on the first compile, by the pool's only thread (it walks the whole vocabulary once: about a
        # second for 50k tokens), so engines without structured requests never pay for it.
        self._grammar_tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[GrammarKey, Future[llguidance.LLMatcher]] = OrderedDict()
        # Mask words of the step (32 tokens per int32), reused; grows with the number of constrained rows.
        self._bitmask = np.empty((0, (vocab_size + 31) // 32), dtype=np.int32)
        self._executor: llguidance.LLExecutor | None = None  # its threads start with the first mask

    def sequence_grammar(self, params: StructuredOutputsParams) -> SequenceGrammar:
        """A fresh matcher state for one sequence; starts the compile if this spec is new. The engine has
        checked that it has a tokenizer."""
        key = params.key
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compiled[key] = self._pool.submit(self._compile, key)
            if len(self._compiled) > _MAX_COMPILED:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        return SequenceGrammar(compiled)

    def _compile(self, key: GrammarKey) -> llguidance.LLMatcher:
        if self._grammar_tokenizer is None:
            self._grammar_tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
            )
        return llguidance.LLMatcher(self._grammar_tokenizer, grammar_text(key), log_level=0)

    def masks(self, grammars: list[SequenceGrammar | None]) -> GrammarMasks | None:
        """The -inf/0 bias of each row that has a grammar (None when no row has one); only those rows are
        computed."""
        constrained = [(row, grammar) for row, grammar in enumerate(grammars) if grammar is not None]
        if not constrained:
            return None
        rows = [row for row, _ in constrained]
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = np.empty((len(rows), self._bitmask.shape[1]), dtype=np.int32)
        bitmask = self._bitmask[: len(rows)]  # the first rows of a C-ordered array: contiguous
        if self._executor is None:
            # Masks are filled between forwards, so they may use the cores the forward uses.
            self._executor = llguidance.LLExecutor(max(1, (os.cpu_count() or 1) // 2))
        matchers = [(grammar.matcher(), k) for k, (_, grammar) in enumerate(constrained)]
        # Row k of the mask is written at data + k * row bytes (what llguidance.torch wraps; importing that
        # module would also compile a torch kernel this engine does not use).
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.ctypes.data, bitmask.strides[0], len(rows))
        # Token t is allowed when bit t % 32 of word t // 32 is set; on a little-endian host that is bit t of
        # the bytes in order. Inverting the words is 32 times less work than inverting the unpacked mask.
        banned = np.invert(bitmask).view(np.uint8)
        bits = np.unpackbits(banned, axis=1, count=self.vocab_size, bitorder="little")
        return GrammarMasks(rows, torch.from_numpy(banned_bias(bits)))
