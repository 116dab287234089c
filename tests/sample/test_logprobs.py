"""Sample and prompt logprobs checked against a float64 log_softmax reference over the raw logits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.sample import Sampler, SamplingMetadata, SamplingRow, TokenLogprobs, compute_prompt_logprobs
from strata.sample import sampler as sampler_module
from strata.sampling_params import SamplingParams


def ref_log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum())


def check_entry(entry: TokenLogprobs, raw_row: np.ndarray, token_id: int, k: int) -> None:
    lp = ref_log_softmax(raw_row)
    assert entry.token_id == token_id
    assert entry.logprob == pytest.approx(lp[token_id], abs=1e-4)
    assert entry.rank == 1 + sum(1 for v in lp if v > lp[token_id])
    order = sorted(range(len(lp)), key=lambda i: -lp[i])[:k]
    assert entry.top_token_ids == order
    np.testing.assert_allclose(entry.top_logprobs, [lp[i] for i in order], atol=1e-4)


def test_sample_logprobs_come_from_raw_logits() -> None:
    rng = np.random.default_rng(0)
    vocab, pad = 30, 2
    params = [
        SamplingParams(logprobs=3, temperature=0.0, repetition_penalty=2.0, presence_penalty=1.5),
        SamplingParams(logprobs=None),
        SamplingParams(logprobs=0, temperature=0.5, top_k=4),
        SamplingParams(logprobs=-1, frequency_penalty=1.0, min_tokens=2),
        SamplingParams(logprobs=5, seed=3, top_p=0.7, min_p=0.05),
        SamplingParams(logprobs=100),  # more than the vocabulary: capped at vocab_size
    ]
    raw = rng.normal(scale=2.0, size=(len(params), vocab + pad)).astype(np.float32)
    raw[:, vocab:] = 40.0  # padding must not enter the normalisation
    rows = [
        SamplingRow(
            p,
            prompt_token_ids=[1, 2, 3],
            output_token_ids=[4, 4, 5],
            generator=torch.Generator().manual_seed(3) if p.seed is not None else None,
        )
        for p in params
    ]
    md = SamplingMetadata.build(rows, vocab, [0], torch.device("cpu"))
    out = Sampler(torch.Generator().manual_seed(0))(torch.tensor(raw), md)
    assert out.logprobs[1] is None
    for i, k in [(0, 3), (2, 0), (3, vocab), (4, 5), (5, vocab)]:
        entry = out.logprobs[i]
        assert entry is not None
        check_entry(entry, raw[i, :vocab], out.sampled_token_ids[i], k)


def test_greedy_penalised_choice_keeps_raw_logprob_and_rank() -> None:
    vocab = 8
    raw = np.array([[0.0, 5.0, 4.0, 1.0, 0.5, 0.2, 0.1, -1.0]], dtype=np.float32)
    p = SamplingParams(temperature=0.0, logprobs=2, repetition_penalty=2.0)
    md = SamplingMetadata.build([SamplingRow(p, [1], [])], vocab, [], torch.device("cpu"))
    out = Sampler()(torch.tensor(raw), md)
    assert out.sampled_token_ids == [2]  # 5 / 2 < 4
    entry = out.logprobs[0]
    assert entry.rank == 2 and entry.top_token_ids == [1, 2]
    assert entry.logprob == pytest.approx(ref_log_softmax(raw[0])[2], abs=1e-5)


def test_tied_top_logprobs_are_ordered_by_lowest_id() -> None:
    raw = torch.tensor([[1.0, 3.0, 0.0, 3.0, 3.0, 2.0, 3.0]])
    p = SamplingParams(temperature=0.0, logprobs=5)
    md = SamplingMetadata.build([SamplingRow(p, [], [])], 7, [], torch.device("cpu"))
    out = Sampler()(raw, md)
    assert out.sampled_token_ids == [1]
    assert out.logprobs[0].top_token_ids == [1, 3, 4, 6, 5]
    assert out.logprobs[0].rank == 1
    prompt = compute_prompt_logprobs(raw.expand(3, -1), torch.tensor([4, 5, 2]), 4)
    assert [e.top_token_ids for e in prompt] == [[1, 3, 4, 6]] * 3
    assert [e.rank for e in prompt] == [1, 5, 7]


@pytest.mark.parametrize("num_logprobs", [0, 2, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_logprobs_match_reference(num_logprobs: int, dtype: torch.dtype) -> None:
    rng = np.random.default_rng(1)
    t, vocab = 9, 20
    logits = torch.tensor(rng.normal(scale=2.0, size=(t, vocab)), dtype=dtype)
    targets = torch.tensor(rng.integers(0, vocab, size=t))
    got = compute_prompt_logprobs(logits, targets, num_logprobs)
    assert len(got) == t
    k = vocab if num_logprobs == -1 else num_logprobs
    ref_logits = logits.float().numpy()
    for i, entry in enumerate(got):
        check_entry(entry, ref_logits[i], int(targets[i]), k)


def test_prompt_logprobs_chunking_and_padding(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(2)
    t, vocab = 11, 16
    logits = rng.normal(size=(t, vocab + 3)).astype(np.float32)
    logits[:, vocab:] = 30.0
    targets = torch.tensor(rng.integers(0, vocab, size=t))
    whole = compute_prompt_logprobs(torch.tensor(logits), targets, 3, vocab_size=vocab)
    monkeypatch.setattr(sampler_module, "_PROMPT_LOGPROBS_CHUNK_ELEMENTS", 3 * vocab)  # 3 rows per chunk
    chunked = compute_prompt_logprobs(torch.tensor(logits), targets, 3, vocab_size=vocab)
    assert chunked == whole
    for i, entry in enumerate(chunked):
        check_entry(entry, logits[i, :vocab], int(targets[i]), 3)


def test_prompt_logprobs_rejects_bad_arguments() -> None:
    logits = torch.zeros(4, 10)
    with pytest.raises(ValueError, match="target_token_ids"):
        compute_prompt_logprobs(logits, torch.zeros(3, dtype=torch.long), 1)
    with pytest.raises(ValueError, match="target_token_ids"):
        compute_prompt_logprobs(logits, torch.tensor([0, 1, 2, 10]), 1)
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_prompt_logprobs(logits, torch.zeros(4, dtype=torch.long), -2)
    with pytest.raises(ValueError, match="vocab_size"):
        compute_prompt_logprobs(logits, torch.zeros(4, dtype=torch.long), 1, vocab_size=11)
