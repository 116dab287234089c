"""Default int8 weight-only linear layer: int8 weights read as they are for decode-sized batches on the CPU.

Batch-1 decode is bound by the bytes of weights read per token, and int8 weights are a quarter of fp32's.
Up to `_SMALL_BATCH_ROWS` rows, `forward_cpu` uses, in order of preference:

- Strata's `strata_cpu::linear` (`cpu_kernels.py`), which widens the int8 weights in registers and takes
  float32 activations and the float32 scales as they are. Measured against the next option, one thread,
  one row, cold caches: 51 vs 87 us on a 576x576 weight, 136 vs 171 us on 3072x576, 1.76 vs 2.03 ms on
  the 49152x576 head.
- ATen's `_weight_int8pack_mm`, where Strata's kernel cannot be built (no C++ compiler). On x86 only its
  bfloat16 kernel is vectorised (the float32 one is a scalar loop, about 10x slower than an fp32 matmul),
  and it uses aligned loads over K in steps of 16: K must be a multiple of 16 and the activation rows
  64-byte aligned, or it reads garbage or crashes (both seen). Activations go in as bfloat16 and the kernel
  gets unit scales; the real scales multiply its output in the model dtype, at full precision.

Wider batches (prefill) multiply the bfloat16 activations by the int8 weights widened to bfloat16 (exact:
int8 fits bfloat16's 8-bit significand) where oneDNN has bfloat16 kernels: on a 3072x576 weight, one
thread, 3.5x faster than ATen's int8 kernel at 512 rows and 4.5x faster than a float32 matmul. Strata's
kernel does this itself, so compiled and eager forwards take the same path; without it, eager forwards do
it here and compiled ones use `forward_native`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.config import get_current_layer_config
from strata.custom_op import CustomOp
from strata.layers import cpu_kernels
from strata.layers.base import Int8LinearBase
from strata.layers.linear import prepacked_copy
from strata.process_local import ProcessLocalValue

# Up to this many rows the int8 kernels win; above it the bfloat16 matmul does (see the module docstring).
_SMALL_BATCH_ROWS = 8
# `_weight_int8pack_mm` steps through K by 16 with aligned loads, from 64-byte aligned activation rows.
_INT8PACK_K_MULTIPLE = 16
_ALIGNMENT = 64
_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


@CustomOp.register("int8_linear")
class Int8Linear(Int8LinearBase):
    """Int8 weight-only linear: per-output-channel symmetric int8 weights times a float scale."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        # Decided here, not per call: torch.compile cannot trace building and loading the kernel.
        self.use_strata_kernel = self.forward_method_name == "forward_cpu" and cpu_kernels.load(
            "small_batch_linear"
        )
        self.prepack = self.use_strata_kernel and get_current_layer_config().prepack_weights
        self._packed_weight: ProcessLocalValue[torch.Tensor] | None = None

    def process_weights_after_loading(self) -> None:
        """With `prepack_weights`, a bfloat16 copy of the int8 weights in oneDNN's layout (`prepacked_copy`),
        which inputs wider than 8 rows multiply instead of widening the weights on every call: twice the
        int8 weights' memory on top of them."""
        if self.prepack:
            self._packed_weight = prepacked_copy(self.qweight)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _ACTIVATION_DTYPES:
            return self.forward_native(x)
        rows = x.reshape(-1, self.in_features)
        if self.use_strata_kernel:
            # Takes any row count (wide inputs go to its bfloat16 matmul) and adds the bias.
            out = torch.ops.strata_cpu.linear(rows, self.qweight, self.scale, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        # Under torch.compile the row count is symbolic: no branch on it, and no data pointers to check.
        compiling = torch.compiler.is_compiling()
        if (
            not compiling
            and rows.shape[0] > _SMALL_BATCH_ROWS
            and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ):
            out = F.linear(rows.to(torch.bfloat16), self.qweight.to(torch.bfloat16)) * self.scale
        elif compiling or self.in_features % _INT8PACK_K_MULTIPLE:
            return self.forward_native(x)
        else:
            rows = rows.to(torch.bfloat16, memory_format=torch.contiguous_format)
            if rows.data_ptr() % _ALIGNMENT:
                rows = rows.clone()
            out = (
                torch.ops.aten._weight_int8pack_mm(rows, self.qweight, self._unit_scale(x.device))
                * self.scale
            )
        if self.bias is not None:
            out = out + self.bias
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _unit_scale(self, device: torch.device) -> torch.Tensor:
        """bfloat16 ones for `_weight_int8pack_mm`'s `scales`, made once (the layer is built on meta)."""
        unit = self.__dict__.get("_unit")
        if unit is None or unit.device != device:
            unit = torch.ones(self.out_features, dtype=torch.bfloat16, device=device)
            self.__dict__["_unit"] = unit
        return unit
