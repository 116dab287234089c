"""Models built under the `kernels` package's Hub-kernel hooks run and compile to saveable traces."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from types import FunctionType

import pytest
import torch
from torch import nn
from torch._dynamo.aot_compile import AOTCompiledFunction

from strata import LLM
from strata.models.transformers.hub_kernels import unwrap_hub_kernels

kernels = pytest.importorskip("kernels")


@kernels.use_kernel_forward_from_hub("StrataTestScale")
def scale(x: torch.Tensor) -> torch.Tensor:
    return 3 * x


@kernels.use_kernelized_func(scale)
class ScaleLayer(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(x) + 1


def _run(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _saved_trace(model: nn.Module, x: torch.Tensor) -> bytes:
    """A trace of `model(x)` serialized as Strata saves its traces (the model an argument, as a layer is)."""
    compiled = torch.compile(_run, backend="eager", fullgraph=True)
    return AOTCompiledFunction.serialize(compiled.aot_compile(((model, x), {}))).serialized_data


def test_unwrapped_layer_compiles_to_a_saveable_trace() -> None:
    model = nn.Sequential(ScaleLayer())
    x = torch.randn(4)
    expected = model(x)
    with pytest.raises(TypeError, match="local scope"):  # the hooks as `kernels` installs them
        _saved_trace(model, x)

    unwrap_hub_kernels(model)

    assert isinstance(sys.modules[__name__].scale, FunctionType)
    assert "_kernel_funcs" not in model[0].__dict__
    torch.testing.assert_close(model(x), expected, rtol=0, atol=0)
    assert _saved_trace(model, x)


def test_built_model_has_no_hub_kernel_hooks(tiny_model_dir: Callable[[str], Path]) -> None:
    from transformers.models.qwen2 import modeling_qwen2

    llm = LLM(str(tiny_model_dir("qwen2")), skip_tokenizer_init=True)
    layers_with_hooks = llm.apply_model(
        lambda model: [name for name, m in model.named_modules() if "_kernel_funcs" in m.__dict__]
    )
    assert layers_with_hooks == []
    assert isinstance(modeling_qwen2.apply_rotary_pos_emb, FunctionType)
    assert "new_forward" not in modeling_qwen2.Qwen2Attention.forward.__code__.co_qualname
