"""The fusers find RMSNorms and GLU MLPs by what they compute, replace them, and load weights into them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.gemma.modeling_gemma import GemmaMLP
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.phi3.modeling_phi3 import Phi3MLP
from transformers.pytorch_utils import Conv1D

from strata.config import LayerConfig, ModelConfig
from strata.custom_op import CustomOp, PluggableLayer
from strata.models.transformers.fusers import WeightTarget, fuse_layers, match_glu, match_rms_norm
from strata.models.transformers.layers import LayerResolver
from strata.models.transformers.loader import WeightLoadError, build_model
from strata.platforms import get_platform

from tiny_models import TINY_CONFIGS


class ScaleNorm(nn.Module):
    """An RMSNorm under other names: the weight is `scale`, eps is `epsilon`."""

    def __init__(self, n: int, epsilon: float = 1e-6) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(n))
        self.epsilon = epsilon

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon)


class WrongEpsNorm(ScaleNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-2)


class SwappedGlu(LlamaMLP):
    """Has the GLU's children but computes `down(act(up(x)) * gate(x))`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)) * self.gate_proj(x))


def test_rms_norms_are_recognised_by_what_they_compute() -> None:
    llama = match_rms_norm(LlamaRMSNorm(16, eps=1e-5))
    assert llama is not None and (llama.weight_name, llama.eps, llama.offset_weight) == (
        "weight",
        1e-5,
        False,
    )
    gemma = match_rms_norm(Gemma3RMSNorm(16, eps=1e-6))
    assert gemma is not None and gemma.offset_weight
    renamed = match_rms_norm(ScaleNorm(16, epsilon=1e-6))
    assert renamed is not None and renamed.weight_name == "scale"
    assert match_rms_norm(WrongEpsNorm(16)) is None
    assert match_rms_norm(nn.LayerNorm(16)) is None  # mean-centred, and two parameters
    assert match_rms_norm(nn.Linear(16, 16)) is None


def test_glu_mlps_are_recognised_by_what_they_compute() -> None:
    llama = TINY_CONFIGS["llama"]()
    glu = match_glu(LlamaMLP(llama))
    assert glu is not None and (glu.hidden_size, glu.intermediate_size, glu.act_name) == (64, 96, "silu")
    gemma = match_glu(GemmaMLP(TINY_CONFIGS["gemma"]()))
    assert gemma is not None and gemma.act_name == "gelu_pytorch_tanh"
    assert match_glu(SwappedGlu(llama)) is None
    assert match_glu(Phi3MLP(TINY_CONFIGS["phi3"]())) is None  # already a merged gate_up_proj: stays


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("layer_impl", ["default", "hw-agnostic"])
def test_every_norm_and_glu_is_replaced(
    arch: str, layer_impl: str, tiny_model_dir: Callable[[str], Path]
) -> None:
    model, _ = build_model(
        ModelConfig(str(tiny_model_dir(arch))), LayerConfig(layer_impl=layer_impl), get_platform("cpu")
    )
    leftovers = [
        path
        for path, module in model.named_modules()
        if not isinstance(module, CustomOp | PluggableLayer)
        and (match_rms_norm(module) is not None or match_glu(module) is not None)
    ]
    assert leftovers == []
    num_norms = sum(isinstance(m, CustomOp) and "rms_norm" in m.op_name for m in model.modules())
    num_glus = sum(isinstance(m, PluggableLayer) for m in model.modules())
    layers = TINY_CONFIGS[arch]().num_hidden_layers
    # Gemma3 has six norms per layer (input, post-attention, pre/post feed-forward, q and k), Olmo2, Qwen3,
    # Apertus and Gemma2 four; Phi, Starcoder2, Cohere, GPT-2, GPT-NeoX and OPT use LayerNorm. Phi3's MLP
    # already merges gate and up and is left as it is, and so are Mixtral's experts (one fused parameter for
    # all of them); Apertus, Phi, Starcoder2, the GPTs and OPT have plain MLPs; Qwen2-MoE's dense shared
    # expert is a GLU, and Qwen3-MoE has experts only.
    layer_norm_archs = ("phi", "starcoder2", "cohere", "gpt2", "gpt_neox", "opt")
    norms_per_layer = {"gemma3": 6, "gemma2": 4, "olmo2": 4, "qwen3": 4, "qwen3_moe": 4, "apertus": 4}.get(
        arch, 2
    )
    assert num_norms == (0 if arch in layer_norm_archs else norms_per_layer * layers + 1)
    # Every nn.LayerNorm is Strata's `layer_norm` (Phi's one a layer: attention and MLP share it); Cohere's
    # own LayerNorm class (no bias, float32) stays.
    num_layer_norms = sum(isinstance(m, CustomOp) and m.op_name == "layer_norm" for m in model.modules())
    assert not any(type(m) is torch.nn.LayerNorm for m in model.modules())
    assert not any(isinstance(m, Conv1D) for m in model.modules())  # GPT-2's: Strata's Linear now
    layer_norms_per_layer = {"phi": 1, "cohere": 0}.get(arch, 2 if arch in layer_norm_archs else 0)
    assert num_layer_norms == (layer_norms_per_layer * layers + 1 if layer_norms_per_layer else 0)
    no_glu = ("phi3", "mixtral", "qwen3_moe", "apertus", "phi", "starcoder2", "gpt2", "gpt_neox", "opt")
    assert num_glus == (0 if arch in no_glu else layers)


def test_merged_gate_up_holds_the_checkpoint_tensors(tiny_model_dir: Callable[[str], Path]) -> None:
    folder = tiny_model_dir("llama")
    model, _ = build_model(ModelConfig(str(folder)), LayerConfig(), get_platform("cpu"))
    checkpoint = load_file(folder / "model.safetensors")
    # Through state_dict: the parameter itself may be a stand-in for the packed panels that replaced it.
    merged = model.state_dict()["model.layers.1.mlp.gate_up_proj.weight"]
    expected = torch.cat(
        [checkpoint["model.layers.1.mlp.gate_proj.weight"], checkpoint["model.layers.1.mlp.up_proj.weight"]]
    )
    assert torch.equal(merged, expected)


def test_weight_mapping_follows_renamed_weights() -> None:
    model = nn.Sequential()
    model.add_module("norm", ScaleNorm(8))
    model.add_module("mlp", LlamaMLP(TINY_CONFIGS["llama"]()))
    mapping = fuse_layers(model, LayerResolver(LayerConfig(), get_platform("cpu")))
    assert model.norm.op_name == "rms_norm" and model.norm.weight.is_meta
    assert mapping["norm.scale"] == WeightTarget("norm.weight")
    assert mapping["mlp.gate_proj.weight"] == WeightTarget("mlp.gate_up_proj.weight", 0, 2)
    assert mapping["mlp.up_proj.weight"] == WeightTarget("mlp.gate_up_proj.weight", 1, 2)
    assert "mlp.down_proj.weight" not in mapping  # same name in the replacement


def test_a_missing_shard_is_named(tmp_path: Path, tiny_model_dir: Callable[[str], Path]) -> None:
    source = tiny_model_dir("llama")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((source / "config.json").read_text())
    tensors = load_file(source / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(
        WeightLoadError, match=r"missing tensors: model\.layers\.0\.mlp\.gate_up_proj\.weight"
    ):
        build_model(ModelConfig(str(broken)), LayerConfig(), get_platform("cpu"))
