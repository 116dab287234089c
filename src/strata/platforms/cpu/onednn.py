"""oneDNN's matmul for the linears of compiled pieces on the CPU, with the weights left as graph inputs.

`F.linear` on a float32 CPU tensor calls the BLAS PyTorch was built with (MKL in the x86 wheels), and
Inductor's compiled pieces keep that call. oneDNN, also part of PyTorch, multiplies the same plain weights
faster on the CPUs measured (docs/performance.md), but Inductor only reaches it through freezing, which bakes
each layer's weights into its piece (one compile per layer, weights in the on-disk cache). So the CPU's
graph pass `linears_to_onednn` rewrites those linears to `strata_onednn::linear`, an op this module defines,
and lowers in Inductor to the extern call of `mkldnn::_linear_pointwise` that freezing would emit: the C++
wrapper calls oneDNN directly, the weight stays an input, and identical layers still share one piece.
"""

from __future__ import annotations

import functools

import torch

# Input dtypes oneDNN multiplies with plain weights of the same dtype.
DTYPES = (torch.float32, torch.bfloat16)

_LIBRARY = "strata_onednn"


def available() -> bool:
    """Whether this PyTorch has oneDNN's CPU matmul."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise.default(x, weight, bias, "none", [], "")


def _linear_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


@functools.cache
def register() -> bool:
    """Define `strata_onednn::linear` and its Inductor lowering (once per process); False where oneDNN is
    missing, and then the pass leaves linears as they are."""
    if not available():
        return False
    from torch._inductor import ir, mkldnn_ir
    from torch._inductor.lowering import register_lowering

    library = torch.library.Library(_LIBRARY, "DEF")
    library.define("linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
    library.impl("linear", _linear, "CPU")
    library._register_fake("linear", _linear_fake)
    register._library = library  # type: ignore[attr-defined]  # a Library unregisters its ops when collected

    @register_lowering(torch.ops.strata_onednn.linear.default)
    def _lower(x: ir.TensorBox, weight: ir.TensorBox, bias: ir.TensorBox | None) -> ir.TensorBox:
        return ir.TensorBox.create(mkldnn_ir.LinearUnary.create(x, weight, bias, "none", [], ""))

    return True
