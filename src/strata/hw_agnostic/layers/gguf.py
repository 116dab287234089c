"""Layers that compute on GGUF weights kept in their file's types: a linear, an embedding table, and the
stacked experts of a mixture of experts.

The weight is the file's raw blocks, one row of bytes per output channel (`qweight`, uint8 [rows,
row_bytes]), often a view of the memory-mapped file itself; `qtype` is its `GGMLQuantizationType`. The
references dequantize in pure PyTorch (`strata.gguf.quants`), so they run on any device;
platforms compute on the blocks directly.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn
from transformers.activations import ACT2FN

from strata.custom_op import CustomOp, PluggableLayer
from strata.gguf.quants import block_layout, dequantize, row_bytes
from strata.hw_agnostic.layers.linear import LinearShape


class GGUFWeight:
    """What the GGUF layers share: the raw weight `qweight`, its type, and how many columns each row holds."""

    qweight: nn.Parameter
    qtype: int
    columns: int

    def _init_weight(self, rows: int, columns: int, qtype: int) -> None:
        self.qtype = int(qtype)
        self.columns = columns
        self.qweight = nn.Parameter(
            torch.empty(rows, row_bytes(self.qtype, columns), dtype=torch.uint8), requires_grad=False
        )

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight, or only `rows` of it."""
        data = self.qweight if rows is None else self.qweight[rows]
        return dequantize(data, self.qtype, self.columns)

    def type_name(self) -> str:
        return GGMLQuantizationType(self.qtype).name


@CustomOp.register("gguf_linear")
class GGUFLinear(GGUFWeight, LinearShape):
    """`x @ W.T + bias` with W a GGUF-typed weight [out_features, in_features]."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        qtype: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self._init_weight(out_features, in_features, qtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, type={self.type_name()}"

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)


@CustomOp.register("gguf_embedding")
class GGUFEmbedding(GGUFWeight, CustomOp):
    """An embedding table of GGUF-typed rows: a lookup dequantizes only the rows it reads, then multiplies
    them by `scale` (Gemma's models scale their embeddings by sqrt(hidden size))."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        qtype: int,
        scale: float | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self._init_weight(num_embeddings, embedding_dim, qtype)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.scale = scale
        self.dtype = dtype or torch.get_default_dtype()

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, type={self.type_name()}, scale={self.scale}, "
            f"forward={self.forward_method_name}"
        )

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        return [(torch.randint(0, self.num_embeddings, (num_tokens,), generator=generator),)]

    def finish(self, rows: torch.Tensor) -> torch.Tensor:
        """Looked-up float32 rows, scaled and in the model's dtype."""
        if self.scale is not None:
            rows = rows * self.scale
        return rows.to(self.dtype)

    def forward_native(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.finish(self.dequantized(flat)).reshape(*ids.shape, self.embedding_dim)


# The three stacks of a GGUF mixture of experts, in the order the layer's qtypes name them.
EXPERT_PROJECTIONS = ("gate", "up", "down")

# x @ W.T for one expert's blocks of one projection (uint8 [rows, row_bytes]) of GGUF type qtype.
ExpertProduct = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def dequantized_product(x: torch.Tensor, qweight: torch.Tensor, qtype: int) -> torch.Tensor:
    """The reference's expert product: the blocks dequantized in pure PyTorch, then `F.linear`."""
    weights, block_bytes = block_layout(qtype)
    return F.linear(x, dequantize(qweight, qtype, qweight.shape[-1] // block_bytes * weights).to(x.dtype))


def mix_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    stacks: list[torch.Tensor],
    qtypes: list[int],
    activation: str,
    product: ExpertProduct,
) -> torch.Tensor:
    """Each token's sum over its chosen experts e of `weight_e * down_e(act(gate_e(x)) * up_e(x))`.

    The (token, choice) pairs are grouped by expert, so each expert's weights are read once, by as many
    rows as chose it; `product` computes each expert's matmuls on its blocks."""
    (gate, up, down), (gate_type, up_type, down_type) = stacks, qtypes
    num_experts, top_k = gate.shape[0], top_k_index.shape[-1]
    act = ACT2FN[activation]
    flat_ids = top_k_index.reshape(-1)
    order = flat_ids.argsort(stable=True)
    # One host sync a step: how many pairs each expert got (ids past the last expert are dropped).
    counts = torch.bincount(flat_ids, minlength=num_experts)[:num_experts].tolist()
    tokens = order // top_k
    routing = top_k_weights.reshape(-1)[order]
    out = torch.zeros_like(hidden_states)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start : start + count]
        x = hidden_states[rows]
        gated = act(product(x, gate[expert], gate_type)) * product(x, up[expert], up_type)
        y = product(gated, down[expert], down_type) * routing[start : start + count, None]
        out.index_add_(0, rows, y.to(out.dtype))
        start += count
    return out


def experts_op(name: str, product: ExpertProduct) -> Callable[..., torch.Tensor]:
    """`mix_experts` with `product` as the custom op `name`, so a compiled forward calls it whole (its
    per-expert loop depends on the routing, which a graph cannot hold); eager forwards call it directly."""

    def impl(
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        stacks: list[torch.Tensor],
        qtypes: list[int],
        activation: str,
    ) -> torch.Tensor:
        return mix_experts(hidden_states, top_k_index, top_k_weights, stacks, qtypes, activation, product)

    def fake(
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        stacks: list[torch.Tensor],
        qtypes: list[int],
        activation: str,
    ) -> torch.Tensor:
        return torch.empty_like(hidden_states)

    op = torch.library.custom_op(name, impl, mutates_args=())
    op.register_fake(fake)

    def call(*args: Any) -> torch.Tensor:
        return op(*args) if torch.compiler.is_compiling() else impl(*args)

    return call


_reference_experts = experts_op("strata::gguf_experts", dequantized_product)


@PluggableLayer.register("gguf_experts")
class GGUFExperts(PluggableLayer):
    """A mixture of experts' gated MLPs on GGUF-typed weights (`mix_experts`).

    It takes the place (and the forward arguments) of a transformers experts module: hidden states [tokens,
    hidden], each token's top-k expert ids and routing weights [tokens, k]. Each projection is a stack of the
    file's blocks, `{gate,up,down}_qweight` uint8 [experts, rows, row_bytes], in its own type (K-quant mixes
    give the down stack another type); `activation` is the gate's, by its transformers name ("silu").
    `dtype` is taken as every layer's constructor takes it; the output has the hidden states' dtype.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        qtypes: tuple[int, int, int],
        activation: str,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.qtypes = [int(q) for q in qtypes]
        self.activation = activation
        columns = (hidden_size, hidden_size, intermediate_size)
        rows = (intermediate_size, intermediate_size, hidden_size)
        for name, qtype, n, k in zip(EXPERT_PROJECTIONS, self.qtypes, rows, columns, strict=True):
            shape = (num_experts, n, row_bytes(qtype, k))
            self.register_parameter(
                f"{name}_qweight", nn.Parameter(torch.empty(shape, dtype=torch.uint8), requires_grad=False)
            )

    def extra_repr(self) -> str:
        types = ", ".join(
            f"{name}={GGMLQuantizationType(q).name}"
            for name, q in zip(EXPERT_PROJECTIONS, self.qtypes, strict=True)
        )
        return (
            f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
            f"{types}, act={self.activation}, forward={self.forward_method_name}"
        )

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        top_k = min(2, self.num_experts)
        hidden = torch.randn(num_tokens, self.hidden_size, generator=generator).to(dtype)
        ids = torch.rand(num_tokens, self.num_experts, generator=generator).argsort(-1)[:, :top_k]
        weights = torch.rand(num_tokens, top_k, generator=generator).softmax(-1).to(dtype)
        return [(hidden, ids, weights)]

    def stacks(self) -> list[torch.Tensor]:
        return [getattr(self, f"{name}_qweight") for name in EXPERT_PROJECTIONS]

    def forward_native(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        return _reference_experts(
            hidden_states, top_k_index, top_k_weights, self.stacks(), self.qtypes, self.activation
        )
