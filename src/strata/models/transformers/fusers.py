"""Replace an HF model's RMSNorms and GLU MLPs with resolved Strata layers, found by what they compute.

Runs after the model is built with parameters on meta and before weights load. A candidate module is
recognised by its structure and then checked numerically on a small random probe (a copy with real random
weights), so any class that computes an RMSNorm (`w * x / rms(x)` or Gemma's `(1 + w) * x / rms(x)`) or
a GLU MLP (`down(act(gate(x)) * up(x))`) is replaced, whatever it is called; anything else stays.
The returned weight mapping tells `load_weights` where each checkpoint tensor of a replaced module goes.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from strata.custom_op import RegisteredLayer
from strata.hw_agnostic.layers.activation import ACTIVATIONS, act_and_mul_op
from strata.models.transformers.layers import LayerResolver

logger = logging.getLogger("strata.models.fusers")

_EPS_ATTRIBUTES = ("variance_epsilon", "eps", "epsilon")
# Probe sizes: a handful of tokens; a narrow intermediate width keeps the GLU probe cheap for big models.
_PROBE_TOKENS = 6
_PROBE_INTERMEDIATE = 16
_ATOL, _RTOL = 1e-5, 1e-4
# Failures a probe forward may raise on a module that is not what it looks like.
_PROBE_ERRORS = (
    RuntimeError,
    TypeError,
    ValueError,
    IndexError,
    AttributeError,
    NotImplementedError,
    AssertionError,
)


@dataclass(frozen=True)
class WeightTarget:
    """Where a checkpoint tensor goes: `param`, or row block `shard` of `num_shards` along dim 0; with
    `expert`, that place in `param[expert]` (one of `num_experts` stacked experts, as transformers fuses a
    mixture of experts' per-expert tensors); with `transpose`, the tensor's transpose."""

    param: str
    shard: int = 0
    num_shards: int = 1
    expert: int | None = None
    num_experts: int = 1
    transpose: bool = False  # stored [in, out], as GPT-2's Conv1D keeps it


WeightMapping = dict[str, WeightTarget]


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), atol=_ATOL, rtol=_RTOL)


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@dataclass(frozen=True)
class NormMatch:
    """An RMSNorm found in the model: its weight's attribute name, eps, and whether it scales by `1 + w`."""

    weight_name: str
    eps: float
    offset_weight: bool


def match_rms_norm(module: nn.Module) -> NormMatch | None:
    """Whether `module` computes an RMSNorm over the last dimension with one weight vector and an eps."""
    params = list(module.named_parameters(recurse=False))
    if list(module.children()) or len(params) != 1 or params[0][1].dim() != 1:
        return None
    eps = next(
        (getattr(module, a) for a in _EPS_ATTRIBUTES if isinstance(getattr(module, a, None), float)), None
    )
    if eps is None:
        return None
    weight_name, weight = params[0]
    generator = _generator()
    probe = copy.deepcopy(module)
    probe_weight = torch.randn(weight.shape[0], generator=generator) * 0.5
    probe._parameters[weight_name] = nn.Parameter(probe_weight, requires_grad=False)
    x = torch.randn(2, _PROBE_TOKENS, weight.shape[0], generator=generator)
    x[1] *= 1e-3  # small enough that eps matters, so a different eps does not match
    try:
        with torch.no_grad():
            out = probe(x)
    except _PROBE_ERRORS:
        return None
    if not isinstance(out, torch.Tensor):
        return None
    normed = _rms(x, eps)
    for offset in (False, True):
        if _close(out, normed * (probe_weight + 1.0 if offset else probe_weight)):
            return NormMatch(weight_name, eps, offset)
    return None


def match_activation(act_fn: object) -> str | None:
    """The HF name of the activation `act_fn` computes, among those with act-and-mul layers."""
    if not callable(act_fn) or (isinstance(act_fn, nn.Module) and any(True for _ in act_fn.parameters())):
        return None
    x = torch.randn(_PROBE_TOKENS, 32, generator=_generator()) * 3
    try:
        with torch.no_grad():
            out = act_fn(x)
    except _PROBE_ERRORS:
        return None
    if not isinstance(out, torch.Tensor):
        return None
    return next((name for name, fn in ACTIVATIONS.items() if _close(out, fn(x))), None)


@dataclass(frozen=True)
class GluMatch:
    """A GLU MLP found in the model: its sizes, the biases of its projections and its HF activation name."""

    hidden_size: int
    intermediate_size: int
    gate_up_bias: bool
    down_bias: bool
    act_name: str


def match_glu(module: nn.Module) -> GluMatch | None:
    """Whether `module` has Linear `gate_proj`/`up_proj`/`down_proj` and an `act_fn`, and computes
    `down(act(gate(x)) * up(x))` (checked with narrow random stand-ins for the three projections)."""
    gate, up, down = (module._modules.get(n) for n in ("gate_proj", "up_proj", "down_proj"))
    if not (isinstance(gate, nn.Linear) and isinstance(up, nn.Linear) and isinstance(down, nn.Linear)):
        return None
    hidden, inter = gate.in_features, gate.out_features
    if (up.in_features, up.out_features, down.in_features, down.out_features) != (
        hidden,
        inter,
        inter,
        hidden,
    ):
        return None
    if (gate.bias is None) != (up.bias is None):
        return None
    act_fn = getattr(module, "act_fn", None)
    act_name = match_activation(act_fn)
    if act_name is None:
        return None
    generator = _generator()
    probe = copy.copy(module)
    probe.__dict__["_modules"] = dict(module._modules)
    stand_ins = {
        "gate_proj": nn.Linear(hidden, _PROBE_INTERMEDIATE, bias=gate.bias is not None),
        "up_proj": nn.Linear(hidden, _PROBE_INTERMEDIATE, bias=up.bias is not None),
        "down_proj": nn.Linear(_PROBE_INTERMEDIATE, hidden, bias=down.bias is not None),
    }
    for name, linear in stand_ins.items():
        for param in linear.parameters():
            param.data = torch.randn(param.shape, generator=generator) * 0.2
        setattr(probe, name, linear)
    x = torch.randn(_PROBE_TOKENS, hidden, generator=generator)
    try:
        with torch.no_grad():
            out = probe(x)
            expected = stand_ins["down_proj"](
                ACTIVATIONS[act_name](stand_ins["gate_proj"](x)) * stand_ins["up_proj"](x)
            )
    except _PROBE_ERRORS:
        return None
    if not isinstance(out, torch.Tensor) or not _close(out, expected):
        return None
    return GluMatch(hidden, inter, gate.bias is not None, down.bias is not None, act_name)


class _Fuser:
    """One model's replacement pass: builds each match's layer through the resolver, records the weights."""

    def __init__(self, resolver: LayerResolver) -> None:
        self.resolver = resolver
        self.mapping: WeightMapping = {}

    def replace_norm(self, path: str, module: nn.Module, match: NormMatch) -> nn.Module:
        weight = module.get_parameter(match.weight_name)
        op = "gemma_rms_norm" if match.offset_weight else "rms_norm"
        with torch.device("meta"):
            new = self.resolver.build(op, weight.shape[0], match.eps, dtype=weight.dtype)
        self.mapping[f"{path}.{match.weight_name}"] = WeightTarget(f"{path}.weight")
        return new

    def replace_glu(self, path: str, module: nn.Module, match: GluMatch) -> nn.Module:
        dtype = module.get_parameter("down_proj.weight").dtype
        act_op, act_kwargs = act_and_mul_op(match.act_name)
        with torch.device("meta"):
            act = self.resolver.build(act_op, **act_kwargs)
            new = self.resolver.build(
                "glu_mlp",
                match.hidden_size,
                match.intermediate_size,
                act,
                match.gate_up_bias,
                match.down_bias,
                dtype,
            )
        params = ["weight", "bias"] if match.gate_up_bias else ["weight"]
        for shard, name in enumerate(("gate_proj", "up_proj")):
            for param in params:
                self.mapping[f"{path}.{name}.{param}"] = WeightTarget(
                    f"{path}.gate_up_proj.{param}", shard, 2
                )
        return new


def fuse_layers(model: nn.Module, resolver: LayerResolver) -> WeightMapping:
    """Replace every RMSNorm and GLU MLP in `model` (parameters on meta) in place; returns the weight mapping."""
    fuser = _Fuser(resolver)
    for path, module in list(model.named_modules()):
        if not path or isinstance(module, RegisteredLayer):
            continue
        glu = match_glu(module)
        if glu is not None:
            new = fuser.replace_glu(path, module, glu)
        elif (norm := match_rms_norm(module)) is not None:
            new = fuser.replace_norm(path, module, norm)
        else:
            continue
        model.set_submodule(path, new)
    return fuser.mapping


def replace_conv1d(model: nn.Module) -> WeightMapping:
    """Replace every `Conv1D` (GPT-2's projections: a linear layer that stores its weight as [in, out]) in
    `model` (parameters on meta) by an `nn.Linear`, which `replace_linears` (or int8 quantization) then
    turns into Strata's; returns the mapping that loads each weight transposed."""
    mapping: WeightMapping = {}
    for path, module in list(model.named_modules()):
        if not isinstance(module, Conv1D):
            continue
        with torch.device("meta"):
            new = nn.Linear(module.nx, module.nf, dtype=module.weight.dtype)
        model.set_submodule(path, new)
        mapping[f"{path}.weight"] = WeightTarget(f"{path}.weight", transpose=True)
    return mapping


def replace_layer_norms(model: nn.Module, resolver: LayerResolver) -> int:
    """Replace every `nn.LayerNorm` over one dimension with learned weights in `model` (parameters on meta) by
    the resolved `layer_norm` layer; returns how many. Parameter names stay `weight` and `bias`, so checkpoints
    load unchanged. Models' own LayerNorm classes (Cohere's, without a bias, in float32) stay as they are."""
    replaced = 0
    for path, module in list(model.named_modules()):
        if (
            type(module) is not nn.LayerNorm
            or not module.elementwise_affine
            or len(module.normalized_shape) != 1
        ):
            continue
        with torch.device("meta"):
            new = resolver.build(
                "layer_norm",
                module.normalized_shape[0],
                module.eps,
                module.bias is not None,
                module.weight.dtype,
            )
        model.set_submodule(path, new)
        replaced += 1
    return replaced


def replace_linears(model: nn.Module, resolver: LayerResolver, op_name: str = "linear") -> int:
    """Replace every plain `nn.Linear` in `model` (parameters on meta) by a resolved layer of `op_name`
    ("linear", or "int8_linear" for weight-only int8); returns how many were replaced.

    Parameter names of "linear" stay `weight` and `bias`, so checkpoints and tied heads load unchanged. Runs
    after the other replacements: the GLU's merged projections are `nn.Linear`s too.
    """
    replaced = 0
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        with torch.device("meta"):
            new = resolver.build(
                op_name, module.in_features, module.out_features, module.bias is not None, module.weight.dtype
            )
        model.set_submodule(path, new)
        replaced += 1
    return replaced
