"""Batch description for one sampling step: per-row parameters gathered into device tensors.

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
        """Gather the rows' parameters; one Python pass over rows, token histories only when needed.

        `vocab_size` is the number of real token ids; logits columns past it are padding and ignored.
        `grammar_masks` are the -inf/0 masks of the rows that have a grammar, `vocab_size` columns wide.
        The min_tokens ban covers `eos_token_ids` even with `ignore_eos` (as vLLM: ignore_eos only
        changes when a request stops, not what may be sampled) plus the row's `stop_token_ids`.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
        if not rows:
            raise ValueError("rows must contain at least one SamplingRow, got an empty list")
        num_rows = len(rows)
        eos = [t for t in eos_token_ids if 0 <= t < vocab_size]

        temperatures: list[float] = []
        greedy: list[bool] = []
        top_ks: list[int] = []
        top_ps: list[float] = []
        min_ps: list[float] = []
        repetition: list[float] = []
        frequency: list[float] = []
        presence: list[float] = []
        generators: dict[int, torch.Generator] = {}
        frequency_rows: list[int] = []
        repetition_rows: list[int] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        num_logprobs: list[int | None] = []
        allowed_rows: list[int] = []
        allowed_masks: list[torch.Tensor] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []

        for i, row in enumerate(rows):
            p = row.params
            if p.seed is not None and row.generator is None:
                raise ValueError(f"rows[{i}] has params.seed={p.seed} but no generator")
            is_greedy = p.is_greedy
            greedy.append(is_greedy)
            temperatures.append(1.0 if is_greedy else p.temperature)
            top_ks.append(p.top_k if 0 < p.top_k < vocab_size else vocab_size)
            top_ps.append(p.top_p)
            min_ps.append(p.min_p)
            if row.generator is not None and not is_greedy:
                generators[i] = row.generator

            repetition.append(p.repetition_penalty)
            frequency.append(p.frequency_penalty)
            presence.append(p.presence_penalty)
            if p.penalizes_repetition:
                repetition_rows.append(i)
            if p.penalizes_output:
                frequency_rows.append(i)

            if p.bans_stop_tokens(len(row.output_token_ids)):
                banned = set(eos)
                banned.update(t for t in p.stop_token_ids if t < vocab_size)
                ban_rows.extend([i] * len(banned))
                ban_ids.extend(banned)

            constraints = row.constraints
            if constraints is not None:
                if constraints.allowed_bias is not None:
                    allowed_rows.append(i)
                    allowed_masks.append(constraints.allowed_bias[:vocab_size])
                if constraints.bad_words:
                    banned_words = constraints.banned_now(list(row.output_token_ids))
                    ban_rows.extend([i] * len(banned_words))
                    ban_ids.extend(banned_words)
                bias_ids.extend(i * vocab_size + t for t in constraints.bias_ids)
                bias_values.extend(constraints.bias_values)

            if p.logprobs is None:
                num_logprobs.append(None)
            else:
                num_logprobs.append(vocab_size if p.logprobs == -1 else min(p.logprobs, vocab_size))

        all_greedy = all(greedy)
        enabled_ks = [k for k in top_ks if k < vocab_size]
        top_p_ks = [k for k, p in zip(top_ks, top_ps, strict=True) if p < 1.0]

        def column(values: list[float], neutral: float) -> torch.Tensor | None:
            if all(v == neutral for v in values):
                return None
            return torch.tensor(values, dtype=torch.float32, device=device).unsqueeze(1)

        repetition_ids = repetition_factors = None
        if repetition_rows:
            seen = torch.cat(
                [
                    _flat_token_index(
                        repetition_rows, [rows[i].prompt_token_ids for i in repetition_rows], vocab_size
                    ),
                    _flat_token_index(
                        repetition_rows, [rows[i].output_token_ids for i in repetition_rows], vocab_size
                    ),
                ]
            )
            repetition_ids = seen.to(device)
            repetition_factors = torch.tensor(repetition, dtype=torch.float32)[seen // vocab_size].to(device)

        output_penalty_ids = output_penalty_offsets = None
        if frequency_rows:
            entries, counts = _flat_token_index(
                frequency_rows, [rows[i].output_token_ids for i in frequency_rows], vocab_size
            ).unique(return_counts=True)
            row_of_entry = entries // vocab_size
            offsets = (
                torch.tensor(frequency, dtype=torch.float32)[row_of_entry] * counts
                + torch.tensor(presence, dtype=torch.float32)[row_of_entry]
            )
            output_penalty_ids = entries.to(device)
            output_penalty_offsets = offsets.to(device)

        token_ban = None
        if ban_rows:
            token_ban = (
                torch.tensor(ban_rows, dtype=torch.long, device=device),
                torch.tensor(ban_ids, dtype=torch.long, device=device),
            )

        def row_masks(
            rows_with_mask: list[int], masks: torch.Tensor
        ) -> tuple[torch.Tensor | None, torch.Tensor]:
            if masks.shape[1] != vocab_size:
                raise ValueError(
                    f"token masks must have vocab_size={vocab_size} columns, got {masks.shape[1]}"
                )
            every_row = rows_with_mask == list(range(num_rows))
            index = None if every_row else torch.tensor(rows_with_mask, dtype=torch.long, device=device)
            return index, masks.to(device)

        grammar_mask = None
        if grammar_masks is not None:
            grammar_mask = row_masks(grammar_masks.rows, grammar_masks.bias)

        return cls(
            num_rows=num_rows,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            greedy_mask=(
                torch.tensor(greedy, dtype=torch.bool, device=device)
                if any(greedy) and not all_greedy
                else None
            ),
            temperature=column(temperatures, 1.0),
            top_k=torch.tensor(top_ks, dtype=torch.long, device=device) if enabled_ks else None,
            top_k_max=max(enabled_ks, default=0),
            top_p=column(top_ps, 1.0),
            top_p_candidates=max(top_p_ks) if top_p_ks and max(top_p_ks) < vocab_size else None,
            min_p=column(min_ps, 0.0),
            generators=generators,
            repetition_ids=repetition_ids,
            repetition_factors=repetition_factors,
            output_penalty_ids=output_penalty_ids,
            output_penalty_offsets=output_penalty_offsets,
            token_ban=token_ban,
            grammar_mask=grammar_mask,
            allowed_tokens_mask=(
                row_masks(allowed_rows, torch.stack(allowed_masks)) if allowed_rows else None
            ),
            logit_bias_ids=torch.tensor(bias_ids, dtype=torch.long, device=device) if bias_ids else None,
            logit_bias_values=(
                torch.tensor(bias_values, dtype=torch.float32, device=device) if bias_ids else None
            ),
            num_logprobs=num_logprobs,
        )


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
