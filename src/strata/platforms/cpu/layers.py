"""The CPU platform's implementations of Strata's ops, each a subclass of the op's reference that adds
`forward_cpu`, most of them through Strata's C++ kernels (`kernels.py`, sources in `csrc/`).

Which of them a layer gets is the resolver's decision, made once per layer from `supports`: an
implementation whose kernel did not build, or that does not take the layer's dtype, declines, and the next
one registered for the op (or the reference) serves. What a kernel then does per call depends on the
call's shape and the weight's form:

- `strata_cpu::linear`: a float32 weight packed after loading (`prepack_weights`, AVX-512 builds) is held
  only as Strata's column panels (bf16x3 items on AMX CPUs under "high" precision), which every row count
  reads. Other weights stay dense: 1 to 8 rows stream them through the small-batch kernel (int8 widened in
  registers), wider inputs go to oneDNN. See `docs/cpu-kernels.md`.
- `strata_cpu::rms_norm`: one pass over each row, the residual add fused in.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from strata.config import get_current_layer_config
from strata.custom_op import register_implementation
from strata.hw_agnostic.layers import (
    GeluAndMul,
    GGUFEmbedding,
    GGUFExperts,
    GGUFLinear,
    GluMLP,
    Int8Linear,
    LayerNorm,
    Linear,
    RMSNorm,
    SiluAndMul,
)
from strata.hw_agnostic.layers.activation import halves
from strata.hw_agnostic.layers.gguf import experts_op
from strata.hw_agnostic.layers.layernorm import GemmaRMSNorm
from strata.platforms.cpu import kernels
from strata.process_local import ProcessLocalValue

# Weight dtypes `strata_cpu::linear` reads (float16 weights take the reference, ATen's F.linear).
_LINEAR_DTYPES = (torch.float32, torch.bfloat16)
# Dtypes `strata_cpu::rms_norm` reads, for x and the weight alike.
_NORM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _needs_kernel(
    name: str, dtype: torch.dtype | None = None, dtypes: tuple[torch.dtype, ...] | None = None
) -> str | None:
    """Why an implementation on kernel `name` cannot serve a layer (of `dtype`, where the kernel takes only
    `dtypes`), or None when it can."""
    dtype = dtype or torch.get_default_dtype()
    if dtypes is not None and dtype not in dtypes:
        return f"strata_cpu kernel {name} does not take {str(dtype).removeprefix('torch.')}"
    if not kernels.load(name):
        return f"strata_cpu kernel {name} is not built"
    return None


# -- normalisation ----------------------------------------------------------------------------------------
class _KernelRMSNorm:
    """`forward_cpu` of both RMSNorms through `strata_cpu::rms_norm` (`fused_add_rms_norm` with a residual).

    The ops take x in any shape [..., hidden] (q/k norms pass [1, tokens, heads, dim]) and are called on it as
    it comes: a reshape in between would hide the residual add from the `fuse_residual_add_into_rms_norm`
    compiler pass."""

    weight: torch.Tensor
    variance_epsilon: float
    weight_offset: bool  # Gemma's `1 + weight`

    @classmethod
    def supports(cls, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> str | None:
        return _needs_kernel("rms_norm", dtype, _NORM_DTYPES)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return torch.ops.strata_cpu.rms_norm(x, self.weight, self.variance_epsilon, self.weight_offset)
        out, new_residual = torch.ops.strata_cpu.fused_add_rms_norm(
            x, residual, self.weight, self.variance_epsilon, self.weight_offset
        )
        return out, new_residual


@register_implementation("cpu")
class CpuRMSNorm(_KernelRMSNorm, RMSNorm):
    weight_offset = False


@register_implementation("cpu")
class CpuGemmaRMSNorm(_KernelRMSNorm, GemmaRMSNorm):
    weight_offset = True


@register_implementation("cpu")
class CpuLayerNorm(LayerNorm):
    """ATen's `layer_norm`: one fused pass where the reference spells the formula out in float32."""

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)


# -- activations ----------------------------------------------------------------------------------------
@register_implementation("cpu")
class CpuSiluAndMul(SiluAndMul):
    """In the input dtype, the product written into the activation's output."""

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = halves(x)
        return F.silu(gate).mul_(up)


@register_implementation("cpu")
class CpuGeluAndMul(GeluAndMul):
    """In the input dtype, the product written into the activation's output."""

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = halves(x)
        return F.gelu(gate, approximate=self.approximate).mul_(up)


# -- linears ------------------------------------------------------------------------------------------
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


def pack_in_place(
    layer: CpuLinear, glu_activation: str | None = None
) -> ProcessLocalValue[torch.Tensor] | None:
    """Pack `layer.weight` for `strata_cpu::linear` (with `glu_activation`: a GLU MLP's [gate; up] for
    `strata_cpu::linear_glu`) and let the packed form replace it, so the weight is held once: the layer's
    `weight` becomes the op's stand-in for the packed tensor (same shape and dtype, no memory) and the dense
    tensor is freed. Returns the packed tensor for the layer to hold (the op keeps weak references only);
    process-local, because a saved compiled trace pickles the layer. A float32 weight is packed under the
    layer's `fp32_matmul_precision` (None: torch's current setting): "high" or "medium" gives bf16x3 items on
    CPUs with AMX. None, the dense weight kept, where the op has no such layout for this weight (float32 on
    AVX-512 builds only) or where another module holds the same weight: an embedding tied to this head
    reads its rows, so the packed form would be a second copy."""
    with float32_matmul_precision(layer.fp32_matmul_precision):
        if glu_activation is None:
            packed = torch.ops.strata_cpu.prepack_linear_weight(layer.weight)
        else:
            packed = torch.ops.strata_cpu.prepack_glu_weight(layer.weight, glu_activation)
    if packed is None:
        return None
    dense = weakref.ref(layer.weight)
    layer.weight = nn.Parameter(torch.ops.strata_cpu.packed_stand_in(layer.weight), requires_grad=False)
    if (shared := dense()) is not None:
        layer.weight = shared
        return None
    return ProcessLocalValue(packed)


def is_stand_in(weight: torch.Tensor) -> bool:
    """Whether `weight` is `strata_cpu::packed_stand_in`'s stand-in for a packed form (every stride 0)."""
    return weight.dim() == 2 and weight.stride() == (0, 0)


def is_bf16x3_copy(weight: torch.Tensor, copy: ProcessLocalValue[torch.Tensor] | None) -> bool:
    """Whether `copy` holds float32 `weight` as bf16x3 items (packed at "high" precision on AMX CPUs), the
    form whose packed tensor is bfloat16."""
    return copy is not None and weight.dtype == torch.float32 and copy.value.dtype == torch.bfloat16


@register_implementation("cpu")
class CpuLinear(Linear):
    """Every batch through `strata_cpu::linear`, which picks its path by the number of rows and the weight's
    form (module docstring); with `prepack_weights` a float32 weight is replaced by its packed form after
    loading (`pack_in_place`), and `state_dict` gives the dense values back."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        layer_config = get_current_layer_config()
        self.prepack = layer_config.prepack_weights
        self.fp32_matmul_precision = layer_config.fp32_matmul_precision
        self._packed_weight: ProcessLocalValue[torch.Tensor] | None = None

    @classmethod
    def supports(
        cls, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> str | None:
        return _needs_kernel("small_batch_linear", dtype, _LINEAR_DTYPES)

    def process_weights_after_loading(self) -> None:
        if self.prepack and self._packed_weight is None:
            self._packed_weight = pack_in_place(self)

    def forward_detail(self) -> str | None:
        return "bf16x3" if is_bf16x3_copy(self.weight, self._packed_weight) else None

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.strata_cpu.linear(x.reshape(-1, self.in_features), self.weight, None, self.bias)
        return out.view(*x.shape[:-1], self.out_features)

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        """The dense weight, unpacked from the packed form that replaced it (for references and checks)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if is_stand_in(self.weight):
            destination[prefix + "weight"] = torch.ops.strata_cpu.unpack_weight(self.weight)


# Activation dtypes the int8 paths take; others run the reference.
_INT8_ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)


@register_implementation("cpu")
class CpuInt8Linear(Int8Linear):
    """Int8 weights through `strata_cpu::linear`, which widens them in registers up to 8 rows and, above,
    multiplies them widened to bfloat16 for the call (exact: int8 fits bfloat16's significand), float32
    activations and scales taken as they are. No packed copy: a bfloat16 one would take twice the int8
    weights' memory (docs/cpu-kernels.md, "Packed weights")."""

    @classmethod
    def supports(cls, *args: Any, **kwargs: Any) -> str | None:
        return _needs_kernel("small_batch_linear")

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _INT8_ACTIVATION_DTYPES:
            return self.forward_native(x)
        out = torch.ops.strata_cpu.linear(
            x.reshape(-1, self.in_features), self.qweight, self.scale, self.bias
        )
        return out.view(*x.shape[:-1], self.out_features)


@register_implementation("cpu")
class CpuGGUFLinear(GGUFLinear):
    """GGUF-typed weights through `strata_cpu::gguf_linear`, which computes on the blocks as they are (the
    file's memory map itself): decoding them in registers for a few rows of x, into float32 panels for a
    float GEMM on wider inputs."""

    @classmethod
    def supports(cls, *args: Any, **kwargs: Any) -> str | None:
        return _needs_kernel("gguf_linear")

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        bias = None if self.bias is None else self.bias.float()
        out = torch.ops.strata_cpu.gguf_linear(rows, self.qweight, self.qtype, bias)
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


@register_implementation("cpu")
class CpuGGUFEmbedding(GGUFEmbedding):
    """A lookup that decodes only the rows it reads, in C++ (`strata_cpu::gguf_embedding`)."""

    @classmethod
    def supports(cls, *args: Any, **kwargs: Any) -> str | None:
        return _needs_kernel("gguf_linear")

    def forward_cpu(self, ids: torch.Tensor) -> torch.Tensor:
        return self.finish(torch.ops.strata_cpu.gguf_embedding(self.qweight, ids, self.qtype))


def _kernel_product(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    return torch.ops.strata_cpu.gguf_linear(x.float(), qweight, qtype, None).to(x.dtype)


_kernel_experts = experts_op("strata::gguf_experts_cpu", _kernel_product)


@register_implementation("cpu")
class CpuGGUFExperts(GGUFExperts):
    """Each expert's products through `strata_cpu::gguf_linear` on its slice of the stacked blocks."""

    @classmethod
    def supports(cls, *args: Any, **kwargs: Any) -> str | None:
        return _needs_kernel("gguf_linear")

    def forward_cpu(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return _kernel_experts(
            hidden_states, top_k_index, top_k_weights, self.stacks(), self.qtypes, self.activation
        )


# Up to this many rows ATen's int8 kernel wins; above it the bfloat16 matmul does.
_INT8PACK_MAX_ROWS = 8
# `_weight_int8pack_mm` steps through K by 16 with aligned loads, from 64-byte aligned activation rows.
_INT8PACK_K_MULTIPLE = 16
_ALIGNMENT = 64


@register_implementation("cpu")
class AtenInt8Linear(Int8Linear):
    """Int8 weights through ATen where Strata's kernel cannot be built (no C++ compiler): its
    `_weight_int8pack_mm` up to 8 rows, a bfloat16 matmul on the widened weights above.

    On x86 only `_weight_int8pack_mm`'s bfloat16 kernel is vectorised, and it uses aligned loads over K in
    steps of 16: K must be a multiple of 16 and the activation rows 64-byte aligned, or it reads garbage.
    Activations go in as bfloat16 with unit scales; the real scales multiply its output at full precision.
    Under torch.compile the row count is symbolic, so compiled forwards take the reference.
    """

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in _INT8_ACTIVATION_DTYPES:
            return self.forward_native(x)
        rows = x.reshape(-1, self.in_features)
        compiling = torch.compiler.is_compiling()
        if (
            not compiling
            and rows.shape[0] > _INT8PACK_MAX_ROWS
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


# -- the GLU MLP ----------------------------------------------------------------------------------------
def _fused_activation(act_and_mul: Any) -> str | None:
    """The activation `linear_glu` computes for this act-and-mul layer, or None: only this platform's own
    SiLU and tanh-GELU layers (a plugin's override, or the reference, keeps its layer)."""
    if type(act_and_mul) is CpuSiluAndMul:
        return "silu"
    if type(act_and_mul) is CpuGeluAndMul and act_and_mul.approximate == "tanh":
        return "gelu_tanh"
    return None


@register_implementation("cpu")
class CpuGluMLP(GluMLP):
    """The projection and the activation as one op, `strata_cpu::linear_glu`, where both are this platform's
    own: the activation is applied to the GEMM's sums in registers, so the [tokens, 2 x intermediate] product
    never goes to memory and back. Decided after loading (where `[gate; up]` packs into paired panels);
    otherwise the sublayers run one after another, as in the reference."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fused_activation: str | None = None
        self._glu_panels: ProcessLocalValue[torch.Tensor] | None = None

    @classmethod
    def supports(cls, *args: Any, **kwargs: Any) -> str | None:
        return _needs_kernel("small_batch_linear")

    def process_weights_after_loading(self) -> None:
        """Pack `[gate; up]` for `linear_glu` where it serves this layer (this platform's Linear, packing its
        weights, no bias, an activation it computes): these panels replace the projection's weight, which
        then packs nothing of its own (the loader reaches this layer before its sublayers)."""
        gate_up, activation = self.gate_up_proj, _fused_activation(self.act_fn)
        if (
            activation is None
            or type(gate_up) is not CpuLinear
            or not gate_up.prepack
            or gate_up.bias is not None
            or self._glu_panels is not None
        ):
            return
        self._glu_panels = pack_in_place(gate_up, activation)
        if self._glu_panels is not None:
            self.fused_activation = activation
            gate_up.prepack = False

    def forward_detail(self) -> str | None:
        if self.fused_activation is None:
            return None
        bf16x3 = ", bf16x3" if is_bf16x3_copy(self.gate_up_proj.weight, self._glu_panels) else ""
        return f"strata_cpu::linear_glu, {self.fused_activation}{bf16x3}"

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_activation is None:
            return self.forward_native(x)
        rows = x.reshape(-1, x.shape[-1])
        hidden = torch.ops.strata_cpu.linear_glu(rows, self.gate_up_proj.weight, self.fused_activation)
        return self.down_proj(hidden.view(*x.shape[:-1], hidden.shape[-1]))
