"""Batch description for one sampling step: per-row parameters gathered into device tensors.

`SamplingMetadata.build` composes one builder per sampling feature (seeds, temperature, top-k/top-p/min-p,
penalties, token bans, allowed tokens, grammar masks, logit bias, logprobs), each reading its rows and
producing that feature's tensors; a new feature is one more builder and its fields.
Every optional tensor is None when no row in the batch needs that stage, so the sampler can skip it.
Penalties, bans and logit biases are sparse (row, token) entries built from the histories, so their
cost follows the number of history tokens rather than batch * vocabulary; only the masks of a grammar
and of `allowed_token_ids` are dense (-inf/0 biases, added), and only for the rows that have them.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from strata.sample.token_constraints import TokenConstraints
from strata.sampling_params import SamplingParams
from strata.structured_output import GrammarMasks


@dataclass
class SamplingRow:
    """What the engine knows about one row of the batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Per-request generator when params.seed is set (it must live on the logits' device), else None.
    generator: torch.Generator | None = None
    # The request's allowed_token_ids, bad_words and logit_bias as token ids, when it sets any.
    constraints: TokenConstraints | None = None


@dataclass
class SamplingMetadata:
    """Tensors the sampler needs for one step; build it with `SamplingMetadata.build`."""

    num_rows: int
    vocab_size: int
    all_greedy: bool
    # bool [B], True for greedy rows; None when no row (or every row) is greedy.
    greedy_mask: torch.Tensor | None
    # float32 [B, 1]; None when every non-greedy row has temperature 1.
    temperature: torch.Tensor | None
    # int64 [B], vocab_size where disabled; None when no row uses top-k. top_k_max is the largest enabled k.
    top_k: torch.Tensor | None
    top_k_max: int
    # float32 [B, 1]; None when no row uses it.
    top_p: torch.Tensor | None
    # Largest top-k among top-p rows when all of them use top-k (top-p then orders only that many
    # tokens), else None (full sort).
    top_p_candidates: int | None
    min_p: torch.Tensor | None
    # Row index -> that row's own generator, for random rows only.
    generators: dict[int, torch.Generator]
    # Penalties are sparse over the batch histories, indexed into the flattened [B * V] logits:
    # (row, id) entries seen in the prompt or output of rows with a repetition penalty, and that row's
    # penalty for each entry (entries may repeat: rewriting the same value is harmless) ...
    repetition_ids: torch.Tensor | None
    repetition_factors: torch.Tensor | None
    # ... and unique (row, id) entries of the outputs of rows with frequency/presence penalties, with
    # the amount to subtract: frequency_penalty * count + presence_penalty.
    output_penalty_ids: torch.Tensor | None
    output_penalty_offsets: torch.Tensor | None
    # (row indices, token ids) to set to -inf: EOS and stop ids before min_tokens, bad words' next tokens.
    token_ban: tuple[torch.Tensor, torch.Tensor] | None
    # Rows with a token mask: (row indices, or None for all rows in order; float32 [rows, V], -inf for a
    # banned token, else 0). The grammar's applies before logprobs (as vLLM's bitmask does), the mask of
    # allowed_token_ids after.
    grammar_mask: tuple[torch.Tensor | None, torch.Tensor] | None
    allowed_tokens_mask: tuple[torch.Tensor | None, torch.Tensor] | None
    # Flattened row * V + id entries and the bias to add to each.
    logit_bias_ids: torch.Tensor | None
    logit_bias_values: torch.Tensor | None
    # Per row: number of top logprobs to return (whole-vocabulary -1 already resolved), or None.
    num_logprobs: list[int | None]

    @classmethod
    def build(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        eos_token_ids: Collection[int],
        device: torch.device,
        grammar_masks: GrammarMasks | None = None,
    ) -> SamplingMetadata:
        """Gather the rows' parameters, one builder per sampling feature; token histories only when needed.

        `vocab_size` is the number of real token ids; logits columns past it are padding and ignored.
        `grammar_masks` are the -inf/0 masks of the rows that have a grammar, `vocab_size` columns wide.
        The min_tokens ban covers `eos_token_ids` even with `ignore_eos` (as vLLM: ignore_eos only
        changes when a request stops, not what may be sampled) plus the row's `stop_token_ids`.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if not rows:
            raise ValueError("rows must contain at least one SamplingRow, got an empty list")
        batch = _Batch(rows, vocab_size, device)
        generators = _generators(batch)
        all_greedy, greedy_mask, temperature = _greedy_and_temperature(batch)
        top_k, top_k_max, top_p, top_p_candidates, min_p = _truncation(batch)
        repetition_ids, repetition_factors = _repetition_penalty(batch)
        output_penalty_ids, output_penalty_offsets = _output_penalties(batch)
        token_ban = _token_ban(batch, eos_token_ids)
        grammar_mask = batch.row_masks(grammar_masks.rows, grammar_masks.bias) if grammar_masks is not None else None
        allowed_tokens_mask = _allowed_tokens_mask(batch)
        logit_bias_ids, logit_bias_values = _logit_bias(batch)
        return cls(
            num_rows=len(rows),
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            top_k_max=top_k_max,
            top_p=top_p,
            top_p_candidates=top_p_candidates,
            min_p=min_p,
            generators=generators,
            repetition_ids=repetition_ids,
            repetition_factors=repetition_factors,
            output_penalty_ids=output_penalty_ids,
            output_penalty_offsets=output_penalty_offsets,
            token_ban=token_ban,
            grammar_mask=grammar_mask,
            allowed_tokens_mask=allowed_tokens_mask,
            logit_bias_ids=logit_bias_ids,
            logit_bias_values=logit_bias_values,
            num_logprobs=_num_logprobs(batch),
        )


# (row indices, or None for all rows in order; float32 [rows, V] -inf/0 biases) of a token mask.
RowMasks = tuple[torch.Tensor | None, torch.Tensor]


class _Batch:
    """The rows of one step and what every feature's builder reads from them."""

    def __init__(self, rows: list[SamplingRow], vocab_size: int, device: torch.device) -> None:
        self.rows, self.vocab_size, self.device = rows, vocab_size, device
        self.params = [row.params for row in rows]
        self.greedy = [p.is_greedy for p in self.params]

    def column(self, values: list[float], neutral: float) -> torch.Tensor | None:
        """float32 [B, 1] of one value per row; None when every row has the `neutral` one."""
        if all(v == neutral for v in values):
            return None
        return torch.tensor(values, dtype=torch.float32, device=self.device).unsqueeze(1)

    def histories(self, row_indices: list[int], output_only: bool = False) -> torch.Tensor:
        """CPU flat indices row * V + id of the tokens of `row_indices`: their prompt, then their output."""
        outputs = _flat_token_index(row_indices, [self.rows[i].output_token_ids for i in row_indices], self.vocab_size)
        if output_only:
            return outputs
        prompts = _flat_token_index(row_indices, [self.rows[i].prompt_token_ids for i in row_indices], self.vocab_size)
        return torch.cat([prompts, outputs])

    def row_masks(self, rows_with_mask: list[int], masks: torch.Tensor) -> RowMasks:
        """A token mask of some rows on the device; the row index is left out when every row has one."""
        if masks.shape[1] != self.vocab_size:
            raise ValueError(f"token masks must have vocab_size={self.vocab_size} columns, got {masks.shape[1]}")
        every_row = rows_with_mask == list(range(len(self.rows)))
        index = None if every_row else torch.tensor(rows_with_mask, dtype=torch.long, device=self.device)
        return index, masks.to(self.device)


def _generators(batch: _Batch) -> dict[int, torch.Generator]:
    """Seeds: each seeded random row's own generator (a greedy row draws nothing)."""
    generators: dict[int, torch.Generator] = {}
    for i, (row, greedy) in enumerate(zip(batch.rows, batch.greedy, strict=True)):
        if row.params.seed is not None and row.generator is None:
            raise ValueError(f"rows[{i}] has params.seed={row.params.seed} but no generator")
        if row.generator is not None and not greedy:
            generators[i] = row.generator
    return generators


def _greedy_and_temperature(batch: _Batch) -> tuple[bool, torch.Tensor | None, torch.Tensor | None]:
    """Greedy rows (all of them, or a mask when mixed) and the temperatures of the random ones."""
    all_greedy = all(batch.greedy)
    greedy_mask = (
        torch.tensor(batch.greedy, dtype=torch.bool, device=batch.device)
        if any(batch.greedy) and not all_greedy
        else None
    )
    temperatures = [1.0 if greedy else p.temperature for p, greedy in zip(batch.params, batch.greedy, strict=True)]
    return all_greedy, greedy_mask, batch.column(temperatures, 1.0)


def _truncation(
    batch: _Batch,
) -> tuple[torch.Tensor | None, int, torch.Tensor | None, int | None, torch.Tensor | None]:
    """Top-k (vocab_size where disabled) with its largest k, top-p with the candidates it need order, min-p."""
    vocab_size = batch.vocab_size
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in batch.params]
    top_ps = [p.top_p for p in batch.params]
    enabled_ks = [k for k in top_ks if k < vocab_size]
    top_p_ks = [k for k, p in zip(top_ks, top_ps, strict=True) if p < 1.0]
    return (
        torch.tensor(top_ks, dtype=torch.long, device=batch.device) if enabled_ks else None,
        max(enabled_ks, default=0),
        batch.column(top_ps, 1.0),
        max(top_p_ks) if top_p_ks and max(top_p_ks) < vocab_size else None,
        batch.column([p.min_p for p in batch.params], 0.0),
    )


def _repetition_penalty(batch: _Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The (row, id) entries of the histories of rows with a repetition penalty, and that penalty for each."""
    penalized = [i for i, p in enumerate(batch.params) if p.penalizes_repetition]
    if not penalized:
        return None, None
    seen = batch.histories(penalized)
    factors = torch.tensor([p.repetition_penalty for p in batch.params], dtype=torch.float32)
    return seen.to(batch.device), factors[seen // batch.vocab_size].to(batch.device)


def _output_penalties(batch: _Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Unique (row, id) entries of the outputs of rows with frequency/presence penalties, and the amount
    to subtract from each: frequency_penalty * count + presence_penalty."""
    penalized = [i for i, p in enumerate(batch.params) if p.penalizes_output]
    if not penalized:
        return None, None
    entries, counts = batch.histories(penalized, output_only=True).unique(return_counts=True)
    row_of_entry = entries // batch.vocab_size
    frequency = torch.tensor([p.frequency_penalty for p in batch.params], dtype=torch.float32)
    presence = torch.tensor([p.presence_penalty for p in batch.params], dtype=torch.float32)
    offsets = frequency[row_of_entry] * counts + presence[row_of_entry]
    return entries.to(batch.device), offsets.to(batch.device)


def _token_ban(batch: _Batch, eos_token_ids: Collection[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, id) pairs that may not be sampled now: EOS and stop ids before min_tokens, bad words' next tokens."""
    vocab_size = batch.vocab_size
    eos = [t for t in eos_token_ids if 0 <= t < vocab_size]
    ban_rows: list[int] = []
    ban_ids: list[int] = []
    for i, row in enumerate(batch.rows):
        p = row.params
        if p.bans_stop_tokens(len(row.output_token_ids)):
            banned = set(eos)
            banned.update(t for t in p.stop_token_ids if t < vocab_size)
            ban_rows.extend([i] * len(banned))
            ban_ids.extend(banned)
        if row.constraints is not None and row.constraints.bad_words:
            banned_words = row.constraints.banned_now(list(row.output_token_ids))
            ban_rows.extend([i] * len(banned_words))
            ban_ids.extend(banned_words)
    if not ban_rows:
        return None
    return (
        torch.tensor(ban_rows, dtype=torch.long, device=batch.device),
        torch.tensor(ban_ids, dtype=torch.long, device=batch.device),
    )


def _allowed_tokens_mask(batch: _Batch) -> RowMasks | None:
    """The -inf/0 masks of the rows with `allowed_token_ids`."""
    allowed = [
        (i, row.constraints.allowed_bias[: batch.vocab_size])
        for i, row in enumerate(batch.rows)
        if row.constraints is not None and row.constraints.allowed_bias is not None
    ]
    if not allowed:
        return None
    return batch.row_masks([i for i, _ in allowed], torch.stack([mask for _, mask in allowed]))


def _logit_bias(batch: _Batch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Flat row * V + id entries of the rows' logit biases, and the bias to add to each."""
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for i, row in enumerate(batch.rows):
        if row.constraints is not None:
            bias_ids.extend(i * batch.vocab_size + t for t in row.constraints.bias_ids)
            bias_values.extend(row.constraints.bias_values)
    if not bias_ids:
        return None, None
    return (
        torch.tensor(bias_ids, dtype=torch.long, device=batch.device),
        torch.tensor(bias_values, dtype=torch.float32, device=batch.device),
    )


def _num_logprobs(batch: _Batch) -> list[int | None]:
    """Each row's number of top logprobs to return, the whole vocabulary's -1 resolved; None for none."""
    vocab_size = batch.vocab_size
    return [
        None if p.logprobs is None else vocab_size if p.logprobs == -1 else min(p.logprobs, vocab_size)
        for p in batch.params
    ]


def _flat_token_index(
    row_indices: list[int], token_lists: list[Sequence[int]], vocab_size: int
) -> torch.Tensor:
    """CPU int64 indices row * vocab_size + id of every token of the given rows (ids outside the vocab dropped).

    Histories are flattened without padding, so the cost is the number of tokens, not rows * longest.
    """
    lengths = torch.tensor([len(ids) for ids in token_lists], dtype=torch.long)
    ids = torch.tensor(list(itertools.chain.from_iterable(token_lists)), dtype=torch.long)
    row_of_id = torch.repeat_interleave(torch.tensor(row_indices, dtype=torch.long), lengths)
    valid = (ids >= 0) & (ids < vocab_size)
    return row_of_id[valid] * vocab_size + ids[valid]
