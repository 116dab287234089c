"""The reference backend's attention of one sequence against the softmax written out in float64."""

from __future__ import annotations

import pytest
import torch

from strata.attention.backends.torch_native import _attend


def _reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_offset: int,
    key_offset: int,
    window: int,
) -> torch.Tensor:
    """query [q, H, D], key/value [k, Hkv, D]: each query position attends to keys at or before it (and
    within `window` of it when positive), its KV head shared by H / Hkv query heads."""
    groups = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(groups, dim=1)
    v = value.double().repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * query.shape[-1] ** -0.5
    q_pos = torch.arange(query.shape[0])[:, None] + query_offset
    k_pos = torch.arange(key.shape[0])[None, :] + key_offset
    allowed = k_pos <= q_pos
    if window > 0:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    ("q_len", "k_len", "query_offset", "key_offset", "window"),
    [
        (37, 37, 0, 0, 0),  # a whole prompt: SDPA's own causal case
        (37, 37, 16, 16, 0),  # a whole prompt after skipped blocks: queries and keys still start together
        (17, 37, 20, 0, 0),  # a chunk after 20 cached tokens: the mask is aligned to the end, not the start
        (37, 37, 0, 0, 8),  # a sliding window keeps its mask
        (1, 37, 36, 0, 0),  # one decoding token sees every key
    ],
)
def test_attention_of_one_sequence_matches_the_written_out_softmax(
    q_len: int, k_len: int, query_offset: int, key_offset: int, window: int
) -> None:
    generator = torch.Generator().manual_seed(q_len + query_offset + window)
    query = torch.randn(q_len, 6, 16, generator=generator)
    key = torch.randn(k_len, 2, 16, generator=generator)
    value = torch.randn(k_len, 2, 16, generator=generator)
    out = _attend(query, key, value, query_offset, key_offset, 16**-0.5, 0.0, window)
    expected = _reference(query, key, value, query_offset, key_offset, window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
