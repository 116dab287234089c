"""The registered ops, each defined by its pure-PyTorch reference (`forward_native`).

Every op Strata swaps into a transformers model is one class here: its parameters (named as the HF module
it replaces names them, so checkpoints load unchanged), its constructor, the random inputs `strata layers
--verify` feeds it, and `forward_native`. These classes run on every device; platforms subclass them with
faster forwards (`strata.platforms.<name>.layers`). Importing this package registers them all.
"""

from strata.hw_agnostic.layers.activation import GeluAndMul, SiluAndMul
from strata.hw_agnostic.layers.gguf import GGUFEmbedding, GGUFExperts, GGUFLinear
from strata.hw_agnostic.layers.layernorm import GemmaRMSNorm, LayerNorm, RMSNorm
from strata.hw_agnostic.layers.linear import Linear
from strata.hw_agnostic.layers.mlp import GluMLP
from strata.hw_agnostic.layers.quantization import Int8Linear

__all__ = [
    "GGUFEmbedding",
    "GGUFExperts",
    "GGUFLinear",
    "GeluAndMul",
    "GemmaRMSNorm",
    "GluMLP",
    "Int8Linear",
    "LayerNorm",
    "Linear",
    "RMSNorm",
    "SiluAndMul",
]
