"""The example platform's one op implementation: the RMSNorm, its reference math behind `forward_example`.

A real platform would call its own kernel here; counting calls lets tests see it really runs.
"""

from __future__ import annotations

import torch

from strata.custom_op import register_implementation
from strata.hw_agnostic.layers import RMSNorm


@register_implementation("example")
class ExampleRMSNorm(RMSNorm):
    """Same numbers as `RMSNorm`; `ExampleRMSNorm.calls` counts forward_example calls in this process."""

    calls = 0

    def forward_example(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        type(self).calls += 1
        return self.forward_native(x, residual)
