"""Strata's CPU argmax (`strata_cpu::argmax_rows`): ATen's argmax exactly, ties, NaN and infinities included,
and the sampler's tokens unchanged by it."""

from __future__ import annotations

import pytest
import torch

from strata.platforms import get_platform
from strata.platforms.cpu import kernels
from strata.sample import Sampler, SamplingMetadata, SamplingRow
from strata.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(
    not kernels.load("argmax"), reason="Strata's CPU argmax cannot be built here (no C++ compiler)"
)


@pytest.mark.parametrize("shape", [(1, 49152), (32, 4099), (3, 17), (5, 1), (2, 100003)])
def test_argmax_rows_equals_aten_on_random_rows(shape: tuple[int, int]) -> None:
    """Widths below, at and past one 16-lane tile, with tails; enough rows to split over threads."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    assert torch.equal(torch.ops.strata_cpu.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_ties_nan_infinities_and_strided_rows_follow_aten() -> None:
    x = torch.zeros(5, 50)
    x[0, 7] = x[0, 30] = 1.0  # a tie: the lower index
    x[1, 40] = x[1, 3] = float("nan")  # NaN wins, the first one
    x[2] = -float("inf")  # all -inf: index 0
    x[3, 45] = float("inf")
    x[4, 49] = float("nan")  # a NaN in the tail after the last full tile
    assert torch.equal(torch.ops.strata_cpu.argmax_rows(x), x.argmax(dim=-1))
    strided = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))[::2, 3:43]
    assert torch.equal(torch.ops.strata_cpu.argmax_rows(strided), strided.argmax(dim=-1))


def test_argmax_rows_refuses_other_inputs() -> None:
    for bad in (torch.zeros(4), torch.zeros(2, 0), torch.zeros(2, 3, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="must be a float32 \\[rows, n\\] tensor"):
            torch.ops.strata_cpu.argmax_rows(bad)


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=50, seed=7)]
)
def test_sampler_tokens_are_the_same_with_and_without_the_kernel(params: SamplingParams) -> None:
    """Greedy rows and the exponential race both take an argmax; a seeded row draws the same noise."""
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(2))

    def sample(platform_argmax: bool) -> list[int]:
        rows = [
            SamplingRow(params, [1, 2], [], torch.Generator().manual_seed(7) if params.seed else None)
            for _ in range(4)
        ]
        metadata = SamplingMetadata.build(rows, 1000, [], torch.device("cpu"))
        argmax = get_platform("cpu").argmax_rows if platform_argmax else None
        sampler = Sampler(torch.Generator().manual_seed(0), argmax)
        return sampler(logits, metadata).sampled_token_ids

    assert sample(True) == sample(False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sampler_argmax_of_half_precision_logits_follows_aten(dtype: torch.dtype) -> None:
    """Half-precision logits are widened for the kernel: exact, so ties (common at 8 bits of mantissa) and
    NaNs pick the index ATen's argmax picks on the original dtype."""
    logits = torch.randn(6, 4099, generator=torch.Generator().manual_seed(3)).to(dtype)
    logits[1, 10] = logits[1, 2000] = 100.0  # a tie: the lower index
    logits[2, 77] = float("nan")
    logits[3] = -float("inf")
    sampler = Sampler(argmax=get_platform("cpu").argmax_rows)
    assert torch.equal(sampler._argmax(logits), logits.argmax(dim=-1))
    assert sampler.greedy(logits) == logits.argmax(dim=-1).tolist()
