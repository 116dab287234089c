"""`strata_onednn::linear`, the op `linears_to_onednn` puts in compiled pieces: what `F.linear` computes, on
weights passed in as inputs, eager and compiled with Inductor's C++ wrapper (its lowering to oneDNN)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata.platforms.cpu import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this PyTorch has no oneDNN")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.strata_onednn.linear(x, weight, bias)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_onednn_linear_matches_f_linear_eager_and_compiled(dtype: torch.dtype, tolerance: float) -> None:
    assert onednn.register()
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 40, generator=generator).to(dtype)
    bias = torch.randn(48, generator=generator).to(dtype)
    compiled = torch.compile(_linear, options={"cpp_wrapper": True})
    inputs = [
        torch.randn(1, 40, generator=generator),
        torch.randn(7, 40, generator=generator),
        torch.randn(2, 3, 40, generator=generator),  # leading dimensions kept
        torch.randn(5, 80, generator=generator)[:, ::2],  # a strided view
    ]
    for x in inputs:
        x = x.to(dtype)
        for b in (None, bias):
            want = F.linear(x.float(), weight.float(), None if b is None else b.float())
            for fn in (_linear, compiled):
                got = fn(x, weight, b)
                assert got.shape == want.shape and got.dtype == dtype
                assert (got.float() - want).abs().max().item() <= tolerance * want.abs().max().item()
