"""Layers that compute on GGUF weights kept in their file's types: a linear and an embedding table.

The weight is the file's raw blocks, one row of bytes per output channel (`qweight`, uint8 [rows,
row_bytes]), often a view of the memory-mapped file itself; `qtype` is its `GGMLQuantizationType`. The
references dequantize in pure PyTorch (`strata.hw_agnostic.gguf_quants`), so they run on any device;
platforms compute on the blocks directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from strata.custom_op import CustomOp
from strata.hw_agnostic.gguf_quants import dequantize, row_bytes
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
