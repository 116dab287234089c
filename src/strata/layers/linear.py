"""The default Linear: ATen's GEMM, and on the CPU Strata's own kernel for decode-sized batches."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from strata import host_memory
from strata.config import get_current_layer_config
from strata.custom_op import CustomOp
from strata.layers import cpu_kernels
from strata.layers.base import LinearBase
from strata.process_local import ProcessLocalValue

logger = logging.getLogger("strata.layers")

# Weight dtypes `strata_cpu::linear` reads; other dtypes (float16) use ATen.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


# A prepacked copy is made only while this share of the machine's memory stays free after it: a model that
# loads without the copies must still load, with room for its KV cache, when they would not fit.
PREPACK_KEEP_FREE_FRACTION = 0.25


@contextlib.contextmanager
def float32_matmul_precision(precision: str | None) -> Iterator[None]:
    """`torch.set_float32_matmul_precision(precision)` for the block (None: as it is), restored after."""
    if precision is None:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def prepacked_copy(
    weight: torch.Tensor, glu_activation: str | None = None, fp32_matmul_precision: str | None = None
) -> ProcessLocalValue[torch.Tensor] | None:
    """Register a packed copy of `weight` with `strata_cpu::linear`, which reads it for prefill and batches
    (float32 on AVX-512 CPUs: the column panels of Strata's own GEMM, from 4 rows on or for weights of 1 MB
    and more; otherwise oneDNN's layout, over 8 rows), and return the copy for the layer to hold: it lives
    as long as the layer, and the op finds it by the weight's storage. Process-local, because a saved
    compiled trace pickles the layer and a oneDNN tensor cannot be pickled. With `glu_activation`, the copy
    is a GLU MLP's [gate; up] weight packed for `strata_cpu::linear_glu` instead. A float32 weight is packed
    under `fp32_matmul_precision` (None: torch's current setting): "high" or "medium" gives bf16x3 items on
    CPUs with AMX. None where the op keeps no copy of this weight, or memory is short."""
    copy_bytes = weight.numel() * (2 if weight.dtype == torch.int8 else weight.element_size())  # int8: bf16
    available = host_memory.available_bytes()
    if available - copy_bytes < PREPACK_KEEP_FREE_FRACTION * host_memory.total_bytes():
        _warn_memory_short(available)
        return None
    with float32_matmul_precision(fp32_matmul_precision):
        if glu_activation is None:
            packed = torch.ops.strata_cpu.prepack_linear_weight(weight)
        else:
            packed = torch.ops.strata_cpu.prepack_glu_weight(weight, glu_activation)
    return None if packed is None else ProcessLocalValue(packed)


def is_bf16x3_copy(weight: torch.Tensor, copy: ProcessLocalValue[torch.Tensor] | None) -> bool:
    """Whether `copy` holds float32 `weight` as bf16x3 items (packed at "high" precision on AMX CPUs), the
    form whose packed tensor is bfloat16."""
    return copy is not None and weight.dtype == torch.float32 and copy.value.dtype == torch.bfloat16


_warned_memory_short = False


def _warn_memory_short(available: int) -> None:
    """Once per process: a model's layers each ask in turn, and the first that finds no room says it."""
    global _warned_memory_short
    if _warned_memory_short:
        return
    _warned_memory_short = True
    logger.warning(
        "%.1f GiB of memory free: layers from here on keep no prepacked weight copy (their prefill and batches "
        "run slower); prepack_weights=False turns the copies off everywhere",
        available / 2**30,
    )


@CustomOp.register("linear")
class Linear(LinearBase):
    """On the CPU every batch goes through `strata_cpu::linear`: up to 8 rows (decode steps) its own kernel
    reads the weights at close to memory bandwidth where ATen's GEMM reaches a third of it; the prepacked
    copy (Strata's panel GEMM, from 4 rows on or for weights of 1 MB and more; oneDNN over 8 rows) or ATen
    takes the rest, so one call serves every batch size, compiled or not."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        # Decided once here, not per call: the build may take seconds and `torch.compile` must not trace it.
        self.use_kernel = (
            self.forward_method_name == "forward_cpu"
            and self.weight.dtype in _KERNEL_DTYPES
            and cpu_kernels.load("small_batch_linear")
        )
        layer_config = get_current_layer_config()
        self.prepack = self.use_kernel and layer_config.prepack_weights
        self.fp32_matmul_precision = layer_config.fp32_matmul_precision
        self._packed_weight: ProcessLocalValue[torch.Tensor] | None = None

    def process_weights_after_loading(self) -> None:
        """With `prepack_weights`, a packed copy of the weight (`prepacked_copy`): for inputs wider than 8 rows
        (prefill, batches) oneDNN's layout measured 1.3x faster than its dense path, and Strata's panels
        1.1-1.5x faster than oneDNN's layout at 9-128 rows (and read from 4 rows on, or from 1 row for
        weights of 1 MB and more); the cost is a second copy of the weight."""
        if self.prepack:
            self._packed_weight = prepacked_copy(
                self.weight, fp32_matmul_precision=self.fp32_matmul_precision
            )
            if is_bf16x3_copy(self.weight, self._packed_weight):
                self.forward_method_name = (
                    f"{self.forward_method_name} (bf16x3 from 4 rows)"  # what reports show
                )

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_kernel:
            return F.linear(x, self.weight, self.bias)
        out = torch.ops.strata_cpu.linear(x.reshape(-1, self.in_features), self.weight, None, self.bias)
        return out.view(*x.shape[:-1], self.out_features)
