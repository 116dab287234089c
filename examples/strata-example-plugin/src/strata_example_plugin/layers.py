"""`CountingRMSNorm`: the hw-agnostic RMSNorm's math behind `forward_oot`, plus a call counter.

A real plugin would call its own kernel in `forward_oot`; counting calls lets tests see it really runs.
"""

from __future__ import annotations

import torch

from strata.hw_agnostic.layers.layernorm import RMSNorm


class CountingRMSNorm(RMSNorm):
    """Same numbers as `RMSNorm`; `CountingRMSNorm.calls` counts forward_oot calls in this process."""

    calls = 0

    def forward_oot(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        type(self).calls += 1
        return self.forward_native(x, residual)
