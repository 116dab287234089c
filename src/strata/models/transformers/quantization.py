"""Weight-only int8: swap an HF model's Linear layers for resolved int8 layers, and read int8 checkpoints.

Every `nn.Linear` is replaced: attention projections, the merged gate/up and down projections the fusers
made, and the LM head. The input embedding stays in floating point; a head tied to it gets its own int8
copy of it (a quarter of its float32 bytes), because at batch 1 the head is often the largest single
matmul of a small model. Weights are quantized per output channel as they load.

Folders stored quantized (`strata convert gguf --keep-quantized`) hold `<linear>.qweight` (int8,
`[out, in]`) and `<linear>.qscale` (float, `[out, in / group_size]`, one scale per group of
`group_size` inputs, 32 for GGUF Q8_0) in place of `<linear>.weight`. The loader dequantizes one such pair
at a time and requantizes it per output channel, the layout the int8 kernels take. The group of each row
with the largest scale keeps its int8 values exactly; the others are rounded once more, with the error
bound of per-channel quantization (half the row's scale).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from strata.custom_op import RegistrationError, op_registry
from strata.hw_agnostic.layers import Int8Linear
from strata.models.transformers.fusers import replace_linears
from strata.models.transformers.layers import LayerResolver

logger = logging.getLogger("strata.models.quantization")

QWEIGHT_SUFFIX = ".qweight"
QSCALE_SUFFIX = ".qscale"


class QuantizedTensorError(ValueError):
    """A quantized checkpoint tensor is malformed (dtype, shape) or lacks its partner."""


def quantize_linears(model: nn.Module, resolver: LayerResolver) -> int:
    """Replace each `nn.Linear` in `model` (parameters on meta) by a resolved `int8_linear` layer; returns how
    many were replaced. An override must keep `Int8Linear`'s interface: the loader quantizes through it."""
    override = op_registry["int8_linear"].oot
    if override is not None and not issubclass(override, Int8Linear):
        raise RegistrationError(
            f"{override.__qualname__}, the override of Int8Linear, must subclass strata.hw_agnostic.layers.Int8Linear"
        )
    replaced = replace_linears(model, resolver, "int8_linear")
    logger.info("int8 weight-only: %d linear layers", replaced)
    return replaced


def dequantize_groups(name: str, qweight: torch.Tensor, qscale: torch.Tensor) -> torch.Tensor:
    """`qweight * qscale` with each scale repeated over its group of inputs, in float32; checks both first."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise QuantizedTensorError(
            f"{name}{QWEIGHT_SUFFIX} must be a 2-D int8 tensor, found {qweight.dtype} "
            f"of shape {tuple(qweight.shape)}"
        )
    rows, cols = qweight.shape
    groups = qscale.shape[1] if qscale.dim() == 2 else 0
    if (
        not qscale.is_floating_point()
        or qscale.dim() != 2
        or qscale.shape[0] != rows
        or not groups
        or cols % groups
    ):
        raise QuantizedTensorError(
            f"{name}{QSCALE_SUFFIX} must be a float tensor of shape [{rows}, G] with G dividing {cols}, "
            f"found {qscale.dtype} of shape {tuple(qscale.shape)}"
        )
    if not bool(torch.isfinite(qscale).all()):
        raise QuantizedTensorError(f"{name}{QSCALE_SUFFIX} holds scales that are not finite")
    return (qweight.float().view(rows, groups, cols // groups) * qscale.float()[:, :, None]).view(rows, cols)
