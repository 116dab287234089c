"""Hardware-agnostic layers: plain PyTorch with float32 intermediate math, the same numbers on every backend."""
