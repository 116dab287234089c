"""Batched, vectorised token sampler with vLLM V1 semantics.

Order (vLLM's): the grammar's mask; logprobs from these raw logits; then the token bans (min_tokens,
bad words), allowed_token_ids, logit_bias, repetition penalty, frequency and presence penalties; greedy
rows take the argmax; random rows apply temperature, top-k, top-p and
min-p, then sample with an exponential race (argmax of probs / q, q ~ Exp(1)). A seeded row draws
its q from its own generator, exactly one vocab-sized draw per step, so its tokens do not depend on
the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from strata.sample.metadata import SamplingMetadata
from strata.sampling_params import SamplingParams

# Rows per log_softmax chunk in compute_prompt_logprobs are sized to keep this many float32 elements.
_PROMPT_LOGPROBS_CHUNK_ELEMENTS = 1 << 25
# Top-p without top-k first orders only this many best tokens; that nearly always covers p.
_TOP_P_PREFIX = 1024


@dataclass
class TokenLogprobs:
    """Logprob information for one position: the chosen token and the top-k alternatives."""

    token_id: int
    logprob: float
    # 1 + number of tokens with a strictly greater logprob.
    rank: int
    # Top-k ids, best first (k = the requested number of logprobs).
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    """One sampled token per row, plus logprobs for rows that asked for them."""

    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Samples the next token of every row in a batch from its logits."""

    def __init__(
        self,
        generator: torch.Generator | None = None,
        argmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        # Engine-wide generator (LLM(seed=...)) for rows without their own; None uses torch's default.
        self.generator = generator
        # Each row's argmax, lowest id on ties: the platform's (`Platform.argmax_rows`), else ATen's.
        self._argmax = argmax or (lambda values: values.argmax(dim=-1))

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax: what `__call__` samples for rows that are all `plain_greedy`, without building
        their metadata, which is a noticeable share of a small model's batch-1 step."""
        return self._argmax(logits).tolist()

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample from `logits` [B, V]; columns at or past `metadata.vocab_size` are padding and ignored."""
        if logits.dim() != 2 or not logits.is_floating_point():
            raise ValueError(
                f"logits must be a 2-D float tensor [B, V], got {logits.dtype} {tuple(logits.shape)}"
            )
        if logits.shape[0] != metadata.num_rows:
            raise ValueError(
                f"logits must have {metadata.num_rows} rows (one per SamplingRow), got {logits.shape[0]}"
            )
        if logits.shape[1] < metadata.vocab_size:
            raise ValueError(
                f"logits must have at least vocab_size={metadata.vocab_size} columns, got {logits.shape[1]}"
            )
        # Most models' logits have no padding columns: skip the slice, which costs a tensor.
        work = logits if logits.shape[1] == metadata.vocab_size else logits[:, : metadata.vocab_size]
        grammar_rows, grammar_mask = metadata.grammar_mask or (None, None)
        if grammar_mask is not None and grammar_rows is None:
            # Every row has a grammar: the masked sum is the working copy (one pass over the logits).
            work = work.to(torch.float32) + grammar_mask
        elif work.dtype != torch.float32 or _modifies_logits(metadata):
            # A fresh float32 copy: the stages below work in place and must not touch the caller's logits.
            work = work.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            if grammar_mask is not None:
                _add_mask(work, grammar_rows, grammar_mask)
        logprob_rows = [i for i, k in enumerate(metadata.num_logprobs) if k is not None]
        raw_logprobs = _raw_logprobs(work, logprob_rows)

        if metadata.token_ban is not None:
            work.index_put_(metadata.token_ban, torch.tensor(float("-inf"), device=work.device))
        if metadata.allowed_tokens_mask is not None:
            _add_mask(work, *metadata.allowed_tokens_mask)
        if metadata.logit_bias_ids is not None:
            work.view(-1).index_add_(0, metadata.logit_bias_ids, metadata.logit_bias_values)
        work = _apply_penalties(work, metadata)

        if metadata.all_greedy:
            sampled = self._argmax(work)
        else:
            greedy_ids = self._argmax(work) if metadata.greedy_mask is not None else None
            sampled = self._sample_random(work, metadata)
            if greedy_ids is not None:
                sampled = torch.where(metadata.greedy_mask, greedy_ids, sampled)

        logprobs: list[TokenLogprobs | None] = [None] * metadata.num_rows
        if raw_logprobs is not None:
            index = torch.tensor(logprob_rows, dtype=torch.long, device=sampled.device)
            ks = [metadata.num_logprobs[i] for i in logprob_rows]
            entries = _token_logprobs(raw_logprobs, sampled.index_select(0, index), ks)
            for row, entry in zip(logprob_rows, entries, strict=True):
                logprobs[row] = entry
        return SamplerOutput(sampled_token_ids=sampled.tolist(), logprobs=logprobs)

    def _sample_random(self, work: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p, then the exponential race; greedy rows pass through unused."""
        if metadata.temperature is not None:
            work.div_(metadata.temperature)
        if metadata.top_k is not None:
            work = _apply_top_k(work, metadata.top_k, metadata.top_k_max)
        if metadata.top_p is not None:
            work = _apply_top_p(work, metadata.top_p, metadata.top_p_candidates)
        probs = work.softmax(dim=-1)
        if metadata.min_p is not None:
            # Ratio to the row's max probability, so it is unaffected by the renormalisation after top-k/p.
            threshold = metadata.min_p * probs.amax(dim=-1, keepdim=True)
            probs.masked_fill_(probs < threshold, 0.0)
        # The race is scale-invariant, so probs need no renormalisation after min-p.
        return self._argmax(probs.div_(self._exponential_noise(probs, metadata)))

    def _exponential_noise(self, probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Exp(1) noise as -log(U): same distribution as exponential_(), but several times faster on CPU."""
        noise = torch.empty_like(probs)
        if len(metadata.generators) < metadata.num_rows:
            # One draw for the whole batch; seeded rows are then overwritten from their own generators.
            noise.uniform_(generator=self.generator)
        for row, generator in metadata.generators.items():
            noise[row].uniform_(generator=generator)
        # A backend whose uniform_ can return exactly 1 would give q = 0 and a NaN argmax winner.
        return noise.log_().neg_().clamp_min_(torch.finfo(noise.dtype).tiny)


def plain_greedy(params: SamplingParams, num_output_tokens: int) -> bool:
    """Whether a row's next token is the argmax of its logits and all it needs: greedy, no logprobs, no
    penalties, no masks or biases, and past `min_tokens` (before it, EOS and stop tokens are banned)."""
    return (
        params.is_greedy
        and params.logprobs is None
        and not params.penalizes_repetition
        and not params.penalizes_output
        and not params.constrains_tokens
        and not params.bans_stop_tokens(num_output_tokens)
    )


def _modifies_logits(metadata: SamplingMetadata) -> bool:
    """Whether any stage writes to the logits: all but greedy rows without bans or penalties, which only
    read them (a copy of a [B, V] row costs as much as the argmax itself)."""
    return not metadata.all_greedy or any(
        value is not None
        for value in (
            metadata.grammar_mask,
            metadata.token_ban,
            metadata.allowed_tokens_mask,
            metadata.logit_bias_ids,
            metadata.repetition_ids,
            metadata.output_penalty_ids,
        )
    )


def _add_mask(work: torch.Tensor, rows: torch.Tensor | None, mask: torch.Tensor) -> None:
    """Add a -inf/0 `mask` [len(rows), V] to `rows` (None: every row): -inf where a token is banned. An
    addition runs several times faster than a masked fill with a boolean mask of the same shape."""
    if rows is None:
        work.add_(mask)
    else:
        work.index_add_(0, rows, mask)


def _raw_logprobs(logits: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
    """log_softmax of the unprocessed logits of `rows` (vLLM's raw logprobs), or None when no row asks."""
    if not rows:
        return None
    if len(rows) < logits.shape[0]:
        logits = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=logits.device))
    return torch.log_softmax(logits, dim=-1)


def _apply_penalties(work: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition penalty (prompt + output, HF/vLLM), then OpenAI frequency and presence (output only).

    Touches only the sparse (row, id) entries of the histories; `work` must be contiguous.
    """
    if metadata.repetition_ids is None and metadata.output_penalty_ids is None:
        return work
    flat = work.view(-1)
    if metadata.repetition_ids is not None:
        ids, factors = metadata.repetition_ids, metadata.repetition_factors
        values = flat[ids]
        flat[ids] = torch.where(values > 0, values / factors, values * factors)
    if metadata.output_penalty_ids is not None:
        flat[metadata.output_penalty_ids] -= metadata.output_penalty_offsets
    return work


def _apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, top_k_max: int) -> torch.Tensor:
    """Keep exactly k tokens per row (ties at the k-th value go to the lowest ids), without a full sort."""
    disabled = top_k >= logits.shape[-1]
    k = top_k.masked_fill(disabled, 1).unsqueeze(1)
    top_values = logits.topk(top_k_max, dim=-1).values
    kth_value = top_values.gather(1, k - 1)
    # Every value strictly above the k-th is among the top k, so counting there is enough.
    room_for_ties = k - (top_values > kth_value).sum(dim=-1, keepdim=True)
    keep = logits >= kth_value
    # Ties at the k-th value are few: walk them as sparse (row, id) pairs, ids ascending within a row.
    tie_rows, tie_ids = (logits == kth_value).nonzero(as_tuple=True)
    ties_per_row = torch.bincount(tie_rows, minlength=logits.shape[0])
    rank_in_row = (
        torch.arange(tie_rows.numel(), device=logits.device)
        - (ties_per_row.cumsum(0) - ties_per_row)[tie_rows]
    )
    surplus = rank_in_row >= room_for_ties.squeeze(1)[tie_rows]
    keep[tie_rows[surplus], tie_ids[surplus]] = False
    return logits.masked_fill_(~(keep | disabled.unsqueeze(1)), float("-inf"))


def _best_first(logits: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `count` largest logits per row and their ids, ordered by (value desc, id asc)."""
    if count == logits.shape[-1]:
        return logits.sort(dim=-1, descending=True, stable=True)
    values, ids = logits.topk(count, dim=-1)
    # topk orders ties arbitrarily: sort by id, then stably by value.
    ids, by_id = ids.sort(dim=-1)
    values, by_value = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, by_value)


def _apply_top_p(logits: torch.Tensor, top_p: torch.Tensor, candidates: int | None) -> torch.Tensor:
    """Keep the smallest best-first prefix whose mass (renormalised after top-k) reaches p.

    Ties are ordered by lowest id, as in `_apply_top_k`. With `candidates` set, top-k left every top-p
    row at most that many finite logits. Otherwise the best `_TOP_P_PREFIX` tokens are tried first and
    the full sort is only paid for when some row needs more of the vocabulary to reach its p.
    """
    width = logits.shape[-1]
    count = candidates if candidates is not None else min(width, _TOP_P_PREFIX)
    sorted_logits, order = _best_first(logits, count)
    log_norm = logits.logsumexp(dim=-1, keepdim=True)
    sorted_probs = (sorted_logits - log_norm).exp()
    if candidates is None and count < width:
        # Tokens tied with the prefix's last value may be missing from it; the ones strictly above are exact.
        exact = sorted_logits > sorted_logits[:, -1:]
        exact_mass = sorted_probs.masked_fill(~exact, 0.0).sum(dim=-1, keepdim=True)
        if not bool(((exact_mass >= top_p) | (top_p >= 1.0)).all()):
            sorted_logits, order = _best_first(logits, width)
            sorted_probs = (sorted_logits - log_norm).exp()
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order, mass_before < top_p)
    # p == 1 keeps everything, even where rounding pushes the running mass to 1 early.
    return logits.masked_fill_(~keep & (top_p < 1.0), float("-inf"))


def _token_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """Chosen-token logprob, rank and top-k from normalised logprobs [N, V]; one host transfer per field."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    max_k = max(ks)
    if max_k > 0:
        # Same (value desc, id asc) order as the sampler, so a greedy token is first among equals.
        values, ids = _best_first(logprobs, max_k)
        top_values, top_ids = values.tolist(), ids.tolist()
    else:
        top_values = top_ids = [[] for _ in ks]
    return [
        TokenLogprobs(
            token_id=token_id,
            logprob=logprob,
            rank=rank,
            top_token_ids=ids[:k],
            top_logprobs=values[:k],
        )
        for token_id, logprob, rank, ids, values, k in zip(
            token_ids.tolist(),
            chosen.squeeze(1).tolist(),
            ranks.tolist(),
            top_ids,
            top_values,
            ks,
            strict=True,
        )
    ]


def compute_prompt_logprobs(
    logits: torch.Tensor,
    target_token_ids: torch.Tensor,
    num_logprobs: int,
    vocab_size: int | None = None,
) -> list[TokenLogprobs]:
    """Logprobs of each next prompt token from the raw logits at the prompt positions.

    `logits` is [T, V], `target_token_ids` [T]; `num_logprobs` is the top-k size (-1 = whole
    vocabulary). Columns at or past `vocab_size` (default: all of V) are padding and ignored.
    Processed in row chunks so a long prompt never needs a full [T, V] float32 copy.
    """
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(
            f"logits must be a 2-D float tensor [T, V], got {logits.dtype} {tuple(logits.shape)}"
        )
    width = logits.shape[1] if vocab_size is None else vocab_size
    if not 1 <= width <= logits.shape[1]:
        raise ValueError(f"vocab_size must be in [1, {logits.shape[1]}], got {vocab_size}")
    if target_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"target_token_ids must have shape ({logits.shape[0]},), got {tuple(target_token_ids.shape)}"
        )
    if isinstance(num_logprobs, bool) or not isinstance(num_logprobs, int) or num_logprobs < -1:
        raise ValueError(f"num_logprobs must be -1 (whole vocabulary) or an int >= 0, got {num_logprobs!r}")
    if (
        target_token_ids.numel()
        and not 0 <= int(target_token_ids.min()) <= int(target_token_ids.max()) < width
    ):
        raise ValueError(f"target_token_ids must be in [0, {width}), got values outside it")
    k = width if num_logprobs == -1 else min(num_logprobs, width)
    targets = target_token_ids.to(device=logits.device, dtype=torch.long)
    chunk = max(1, _PROMPT_LOGPROBS_CHUNK_ELEMENTS // width)
    result: list[TokenLogprobs] = []
    for start in range(0, logits.shape[0], chunk):
        stop = start + chunk
        logprobs = torch.log_softmax(logits[start:stop, :width].float(), dim=-1)
        result.extend(_token_logprobs(logprobs, targets[start:stop], [k] * logprobs.shape[0]))
    return result
